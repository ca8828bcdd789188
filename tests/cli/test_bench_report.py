"""`hal bench`'s table leaves out what the device could not measure, and says when timings were noisy."""

from __future__ import annotations

import io

from rich.console import Console

from bench.cases import CaseResult
from bench.report import print_report, table
from bench.timing import NOISY_SPREAD, DeviceTimer, stable_median_us


def _headers(results: list[CaseResult]) -> list[str]:
    return [str(c.header) for c in table(results, "t").columns]


def _case(**kw: object) -> CaseResult:
    base = dict(eager_us=800.0, direct_eager_us=700.0, loop_us=2000.0, weight_bytes=3.0e5, flops=1.0e6)
    return CaseResult("tiny", 8, "bf16", **{**base, **kw})  # type: ignore[arg-type]


def test_rates_are_left_out_without_the_devices_ceilings():
    headers = _headers([_case()])
    assert "GB/s" not in headers and "TF/s" not in headers and "eager" in headers
    assert _case().derived()["weight_GBps"] is None


def test_small_rates_are_not_rounded_to_zero_where_measured():
    case = _case(roofline_us=100.0, graph_us=600.0, direct_graph_us=590.0)
    headers = _headers([case])
    cells = dict(zip(headers, table([case], "t").columns))
    rate = next(iter(cells["GB/s"].cells))
    assert rate == f"{3.0e5 / 600e-6 / 1e9:.2g}" and float(rate) > 0


class _ScriptedTimer(DeviceTimer):
    """A timer returning given round medians, to pin how many rounds `stable_median_us` takes."""

    def __init__(self, medians: list[float]) -> None:
        self.medians, self.calls = list(medians), 0

    def median_us(self, fn, *, warmup, repeats):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.medians.pop(0)


def test_rounds_are_added_until_the_medians_agree():
    timer = _ScriptedTimer([500.0, 100.0, 20.0, 101.0, 100.0, 100.5, 999.0])
    median, spread = stable_median_us(timer, lambda i: None, warmup=0, repeats=1)
    assert timer.calls == 6 and median == 100.5 and spread <= NOISY_SPREAD


def test_rounds_are_bounded_and_the_result_called_noisy():
    timer = _ScriptedTimer([100.0, 2000.0] * 10)
    median, spread = stable_median_us(timer, lambda i: None, warmup=0, repeats=1, max_rounds=5)
    assert timer.calls == 5 and spread > NOISY_SPREAD
    out = io.StringIO()
    results = [_case(eager_spread=spread), _case(eager_spread=0.01)]
    print_report(
        Console(file=out, width=200),
        {"device": "cpu", "vendor": "cpu", "torch": "x", "date": "d", "note": "n"},
        results,
    )
    assert "noisy timings" in out.getvalue() and f"±{100 * spread:.0f}%" in out.getvalue()
    assert sum(r.noisy for r in results) == 1
