"""The cases of the gloo expert-parallel world (`tests/support/ep_worker.py`), shared with the test module
that parametrizes over them: sizes, the case table and the token patterns."""

from __future__ import annotations

from dataclasses import dataclass

NUM_EXPERTS = 8
HIDDEN = 256
INTERMEDIATE = 64
TOP_K = 2
EVEN_TOKENS = 12  #: tokens per rank of the "even" pattern; also its low-latency capacity (full)
CAPACITY = 16  #: low-latency capacity of the other patterns (above their largest rank)
OVERFLOW_CAPACITY = 4
AUTO_SMALL_CAPACITY = 3  #: below the largest rank's tokens of the "uneven" pattern (4 or 10), above rank 0's (1)
COLLECTIVE_TIMEOUT_S = 30

SCHEMES = ("unquantized", "w8a8-int8", "w8a8-fp8-block")
DTYPES = ("bf16", "fp8", "int8")  # the CPU vendor's dispatch dtypes every scheme here accepts
#: One (scheme, dispatch dtype) pair per wire format family, for the variant cases.
NATIVE = (("unquantized", "bf16"), ("w8a8-int8", "int8"), ("w8a8-fp8-block", "fp8"))


@dataclass(frozen=True)
class Case:
    """One expert-parallel scenario; `kind` picks what the worker runs and records."""

    id: str
    kind: str  #: "equal" | "format" | "overflow" | "indivisible"
    scheme: str = "unquantized"
    dtype: str = "bf16"
    low_latency: bool = False
    tokens: str = "even"  #: "even" | "uneven" | "zero-rank" (see `tokens_per_rank`)
    hidden: int = HIDDEN
    x_dtype: str = "fp32"
    router: str = "softmax"  #: "softmax" | "grouped-sigmoid"
    dead_experts: bool = False  #: logits that never pick `dead_experts(world)`
    auto_capacity: int | None = None  #: ep_mode "auto" with this capacity (low_latency is then ignored)


def _equal_cases() -> list[Case]:
    cases = []
    for ll in (False, True):
        mode = "ll" if ll else "normal"
        for scheme in SCHEMES:
            for dt in DTYPES:
                cases.append(Case(f"{mode}-{scheme}-{dt}", "equal", scheme, dt, ll))
        for scheme, dt in NATIVE:
            cases.append(Case(f"{mode}-{scheme}-{dt}-uneven", "equal", scheme, dt, ll, tokens="uneven"))
            cases.append(Case(f"{mode}-{scheme}-{dt}-zero-rank", "equal", scheme, dt, ll, tokens="zero-rank"))
            cases.append(
                Case(f"{mode}-{scheme}-{dt}-dead-experts", "equal", scheme, dt, ll, tokens="uneven", dead_experts=True)
            )
        cases.append(
            Case(
                f"{mode}-w8a8-fp8-block-fp8-grouped-sigmoid",
                "equal",
                "w8a8-fp8-block",
                "fp8",
                ll,
                tokens="uneven",
                router="grouped-sigmoid",
            )
        )
        for scheme, dt in (("unquantized", "bf16"), ("w8a8-fp8-block", "fp8")):
            cases.append(Case(f"{mode}-{scheme}-{dt}-bf16-input", "equal", scheme, dt, ll, x_dtype="bf16"))
        for scheme in ("unquantized", "w8a8-fp8-block"):
            cases.append(Case(f"{mode}-{scheme}-fp8-h200", "equal", scheme, "fp8", ll, tokens="uneven", hidden=200))
        for model in ("fp16", "fp32"):  # unquantized models, dispatched in their own dtype (2H / 4H records)
            cases.append(Case(f"{mode}-{model}-model", "equal", model, "auto", ll, tokens="uneven"))
    for scheme, dt in NATIVE:  # auto: every rank's batch fits (low-latency), or one rank's does not (normal)
        cases.append(Case(f"auto-fits-{scheme}-{dt}", "equal", scheme, dt, tokens="uneven", auto_capacity=CAPACITY))
        cases.append(
            Case(f"auto-over-{scheme}-{dt}", "equal", scheme, dt, tokens="uneven", auto_capacity=AUTO_SMALL_CAPACITY)
        )
    return cases


EQUAL_CASES = _equal_cases()
FORMAT_CASES = [
    Case(
        f"format-{scheme}-{dt}" + ("" if h == HIDDEN else f"-h{h}"),
        "format",
        scheme,
        dt,
        True,
        tokens="uneven",
        hidden=h,
        dead_experts=True,
    )
    for scheme, dt, h in (
        ("unquantized", "bf16", HIDDEN),
        ("w8a8-int8", "int8", HIDDEN),
        ("w8a8-int8", "fp8", HIDDEN),  # fp8 with per-token scales
        ("w8a8-fp8-block", "fp8", HIDDEN),  # fp8 with 128-channel group scales
        ("w8a8-fp8-block", "fp8", 200),  # ... and a partial last group
    )
]
OVERFLOW_CASE = Case("overflow", "overflow", "w8a8-fp8-block", "fp8", True)
INDIVISIBLE_CASES = [Case(f"indivisible-{m}", "indivisible", low_latency=(m == "ll")) for m in ("normal", "ll")]
CASES = [*INDIVISIBLE_CASES, OVERFLOW_CASE, *FORMAT_CASES, *EQUAL_CASES]


def tokens_per_rank(pattern: str, world: int) -> list[int]:
    """Tokens each rank routes: even (12 each), uneven (3r + 1), zero-rank (rank 1 has none)."""
    if pattern == "even":
        return [EVEN_TOKENS] * world
    if pattern == "uneven":
        return [3 * r + 1 for r in range(world)]
    if pattern == "zero-rank":
        return [0 if r == 1 else 5 + 2 * r for r in range(world)]
    raise ValueError(pattern)


def capacity_for(case: Case) -> int | None:
    """The low-latency capacity of a case (exactly full for the even pattern); None for normal mode."""
    if case.auto_capacity is not None:
        return case.auto_capacity
    if not case.low_latency:
        return None
    return EVEN_TOKENS if case.tokens == "even" else CAPACITY


def dead_experts(world: int) -> list[int]:
    """Experts no token picks in dead-expert cases: expert 1 and every expert of the last rank."""
    local = NUM_EXPERTS // world
    return sorted({1, *range(NUM_EXPERTS - local, NUM_EXPERTS)})


def indivisible_experts(world: int) -> int:
    """An expert count the world size does not divide (6 on 4 ranks, 3 on 2)."""
    return 3 * world // 2
