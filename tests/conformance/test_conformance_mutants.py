"""The conformance suite measured by mutation: every mutant vendor (`tests.support.mutant_vendors`, one
fault each) fails `hal conformance` on its subset, and `docs/conformance-mutants.md` lists exactly the
tests that catch it. The fast tier checks that the page covers every mutant and every op family with no
survivor; the slow tier runs each mutant (one subprocess each) and compares with the page."""

from __future__ import annotations

import re

import pytest

from scripts.mutation_report import PAGE, load_results, render, run_mutant
from tests.support.mutant_vendors import MUTANTS, write_mutant_vendors

#: The op families and features every measurement must cover with at least one mutant.
FAMILIES = {
    "quantize",
    "grouped matmul (int8)",
    "grouped matmul (int4)",
    "grouped matmul (nvfp4)",
    "grouped matmul (fp8)",
    "activations",
    "expert biases",
    "sort and permute",
    "combine",
    "routing",
    "shared experts",
    "accumulate_counts",
    "concurrency",
    "EP dispatchers",
}


def _page_rows() -> dict[str, list[str]]:
    """Mutant name -> the tests the page says catch it."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        found = re.match(r"\| `(mutant-[\w-]+)` \|.*\| ([^|]*) \|$", line)
        if found:
            rows[found.group(1)] = re.findall(r"`([^`]+)`", found.group(2))
    return rows


def test_every_family_has_a_mutant_and_names_are_unique():
    assert FAMILIES <= {m.family for m in MUTANTS}
    assert len({m.name for m in MUTANTS}) == len(MUTANTS) == len({m.cls for m in MUTANTS})


def test_the_page_lists_every_mutant_as_caught():
    rows = _page_rows()
    assert set(rows) == {m.name for m in MUTANTS}, "regenerate: python scripts/mutation_report.py"
    assert PAGE.read_text() == render(load_results()), "the page is not the rendering of its results file"
    survivors = [name for name, caught in rows.items() if not caught]
    assert not survivors, f"mutants no conformance test catches (missing tests): {survivors}"


@pytest.mark.slow  # a `hal conformance` subprocess per mutant
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_conformance_fails_each_mutant_where_the_page_says(tmp_path, mutant):
    site = write_mutant_vendors(tmp_path / "site")
    result = run_mutant(mutant, site, tmp_path / "report")
    assert result["exit"] != 0 and result["caught_by"], f"{mutant.name} survives: {mutant.fault}"
    assert result["caught_by"] == _page_rows()[mutant.name], "regenerate: python scripts/mutation_report.py"
