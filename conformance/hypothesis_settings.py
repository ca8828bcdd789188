"""The settings of the suite's property-based tests (needs hypothesis, the `[test]` extra)."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

#: Examples per property test at each depth.
EXAMPLES = {"quick": 12, "full": 150}


def property_settings(depth: str) -> settings:
    """Derandomized, no example database, no deadline; quick runs report the first failing example
    as drawn (shrinking it would cost a faulty vendor's run minutes)."""
    phases = tuple(Phase) if depth == "full" else (Phase.explicit, Phase.generate)
    return settings(
        max_examples=EXAMPLES[depth],
        derandomize=True,
        database=None,
        deadline=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
