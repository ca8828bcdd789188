"""bf16 grouped GEMMs on quack-kernels' CuTe DSL GEMM (sm90, where it is installed) against float64 (GPU only).

The vendor runs quack where a tuned table names it; these tests force it (`CudaVendor(force_runner="quack")`)
and count the calls that reach quack's `gemm`, so a silent fallback to the other runners fails them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import moe
from hal import ActivationKind, GemmKind, Groups, QuantizedWeight
from tests.support.cuda_graph import capture
from tests.support.moe_reference import TOLERANCE, random_weights, reference_moe, relative_error, softmax_topk
from tests.support.plugin_dist import environment_with, write_distribution
from vendors.cuda import CudaVendor
from vendors.cuda.tuning import QUACK


def _forced() -> CudaVendor | None:
    if not torch.cuda.is_available():
        return None
    vendor = CudaVendor(force_runner=QUACK)
    quack = getattr(vendor.ops, "quack", None)
    return vendor if quack is not None and quack.gemm() is not None else None


_VENDOR = _forced() if torch.cuda.is_available() else None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_VENDOR is None, reason="needs a CUDA sm90 device with quack-kernels installed"),
]


@pytest.fixture
def quack_calls(monkeypatch):
    """The number of calls that reached quack's `gemm` (its function wrapped for the test)."""
    quack = _VENDOR.ops.quack
    real, calls = quack.gemm(), []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("A_idx") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(quack, "_gemm", counted)
    return calls


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("top_k", [1, 8])
def test_a_bf16_grouped_gemm_on_quack_matches_float64(gated, top_k, quack_calls):
    """128 experts, 1,500 tokens, K 1,032 and N 776 (multiples of 8, not of 128); a first projection reads its
    rows through the dispatch's index, with SiLU-GLU after."""
    experts, tokens, k, n = 128, 1500, 1032, 776
    g = torch.Generator().manual_seed(top_k)
    picks = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.reshape(-1)
    counts = torch.bincount(picks, minlength=experts)
    index = torch.sort(picks, stable=True).indices // top_k
    x = torch.randn(tokens if gated else tokens * top_k, k, generator=g).bfloat16()
    w = (torch.randn(experts, k, n, generator=g) / k**0.5).bfloat16()
    groups, wq = Groups.from_counts(counts.cuda()), QuantizedWeight(w.cuda())
    rows = x.double()[index] if gated else x.double()
    ref = torch.cat([part @ w[e].double() for e, part in enumerate(rows.split(counts.tolist()))])
    if gated:
        ref = torch.nn.functional.silu(ref[:, : n // 2]) * ref[:, n // 2 :]
        y = _VENDOR.grouped_matmul(x.cuda(), wq, groups, activation=ActivationKind.SILU_GLU, row_index=index.cuda())
    else:
        y = _VENDOR.grouped_matmul(x.cuda(), wq, groups)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert relative_error(y.cpu(), ref) < 1e-2
    assert quack_calls == [gated]


def test_a_bf16_layer_on_quack_matches_float64_and_its_graph_replay_equals_eager(quack_calls):
    experts, hidden, inter, top_k, tokens = 64, 1032, 392, 8, 700
    w13, w2 = random_weights(experts, hidden, inter, 31)
    layer = moe.MoELayer.from_float(w13.cuda(), w2.cuda(), top_k, scheme="unquantized", vendor=_VENDOR)
    g = torch.Generator().manual_seed(32)
    x, logits = torch.randn(tokens, hidden, generator=g).bfloat16(), torch.randn(tokens, experts, generator=g)
    xd, ld = x.cuda(), logits.cuda()
    y = layer(xd, ld)
    ids, weights = softmax_topk(logits, top_k)
    assert relative_error(y.cpu(), reference_moe(x, ids, weights, w13, w2)) < TOLERANCE[("unquantized", "bf16")]
    assert quack_calls == [True, False]
    graph, out = capture(lambda: layer(xd, ld))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)


def test_the_conformance_gemm_cases_hold_with_quack_forced(quack_calls):
    """The conformance suite's bf16 grouped-GEMM checks, quack forced: empty groups, groups as int32 offsets,
    rows read through an index, strided operands, and the gate/up call with SiLU-GLU."""
    from conformance.checks import run_activated_gemm_case, run_gemm_case

    counts = [0, 37, 1, 0, 260, 5, 0, 129]
    run_gemm_case(_VENDOR, GemmKind.BF16, counts, k=264, n=136)
    run_gemm_case(_VENDOR, GemmKind.BF16, counts, k=264, n=136, offsets=True, group_dtype=torch.int32)
    run_gemm_case(_VENDOR, GemmKind.BF16, counts, k=264, n=136, gather_from=97)
    run_gemm_case(_VENDOR, GemmKind.BF16, counts, k=264, n=136, strided_x=True, strided_w=True)
    run_activated_gemm_case(_VENDOR, GemmKind.BF16, counts, ActivationKind.SILU_GLU, k=264, n=272, gather_from=97)
    assert len(quack_calls) >= 4


def test_tune_times_quack_beside_the_others_and_a_quack_winner_keeps_a_fallback():
    from hal import GemmProblem
    from vendors.cuda import tuner
    from vendors.cuda.tune_case import TuneCase

    problem = GemmProblem(GemmKind.BF16, 16, 1024, 2 * 512, 4, (2048,), ActivationKind.SILU_GLU)
    gemm = _VENDOR.ops.quack.gemm()
    case = TuneCase(problem, 2048, torch.device("cuda"), torch.Generator().manual_seed(0), None, gemm)
    timed = tuner._search(case, problem, 3, True, True)
    assert (QUACK, None, True) in timed and any(backend != QUACK for backend, _, _ in timed)
    y = case.run((QUACK, None, True), 0, True)
    want = case.run(next(c for c in timed if c[0] != QUACK), 0, True)
    assert relative_error(y.double().cpu(), want.double().cpu()) < 1e-2
    best = (QUACK, None, True)
    choice = tuner._recorded(case, timed, best, best, best)
    assert choice.backend == QUACK and choice.fallback is not None and choice.fallback.backend != QUACK


def test_a_layer_whose_quack_calls_raise_runs_the_fallbacks_and_still_matches_float64(monkeypatch):
    vendor = CudaVendor(force_runner=QUACK)
    quack = vendor.ops.quack
    assert quack.gemm() is not None

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this problem")

    monkeypatch.setattr(quack, "_gemm", broken)
    experts, hidden, inter, top_k, tokens = 16, 520, 264, 4, 300
    w13, w2 = random_weights(experts, hidden, inter, 41)
    layer = moe.MoELayer.from_float(w13.cuda(), w2.cuda(), top_k, scheme="unquantized", vendor=vendor)
    g = torch.Generator().manual_seed(42)
    x, logits = torch.randn(tokens, hidden, generator=g).bfloat16(), torch.randn(tokens, experts, generator=g)
    y = layer(x.cuda(), logits.cuda())
    ids, weights = softmax_topk(logits, top_k)
    assert relative_error(y.cpu(), reference_moe(x, ids, weights, w13, w2)) < TOLERANCE[("unquantized", "bf16")]
    assert len(quack.failed) == 2  # both projections' problems, remembered
    assert torch.equal(layer(x.cuda(), logits.cuda()), y)


FORCED_VENDOR = '''
    from vendors.cuda import CudaVendor


    class CudaQuackVendor(CudaVendor):
        """The CUDA vendor with quack-kernels forced on every bf16 grouped GEMM it can take."""

        name = "cuda-quack"
        priority = 0
        description = "CUDA, quack forced (test plugin)"

        def __init__(self, device_index=None, **options):
            super().__init__(device_index, force_runner="quack", **options)
'''


@pytest.mark.slow
def test_the_conformance_suite_passes_on_the_cuda_vendor_with_quack_forced(tmp_path):
    """The whole shared suite (quick depth) through `hal conformance`, on a plugin vendor that is the CUDA vendor
    with quack forced: every bf16 grouped GEMM the suite makes runs on quack where quack takes it."""
    write_distribution(
        tmp_path / "plugin",
        "cuda-quack-forced",
        {"hal.vendors": {"cuda-quack": "cuda_quack_forced:CudaQuackVendor"}},
        {"cuda_quack_forced": FORCED_VENDOR},
    )
    command = [sys.executable, "-m", "hal", "conformance", "--vendor", "cuda-quack", "-n", "8"]
    run = subprocess.run(
        [*command, "--report", str(tmp_path / "report")],
        env=environment_with(tmp_path / "plugin"),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "cuda-quack:" in run.stdout and " 0 failed" in run.stdout


def test_tune_skips_a_quack_candidate_that_raises_and_keeps_searching(monkeypatch):
    from hal import GemmProblem
    from vendors.cuda import tuner
    from vendors.cuda.tune_case import TuneCase

    def broken(*args, **kwargs):
        raise TypeError("DSL: unsupported operand layout")

    problem = GemmProblem(GemmKind.BF16, 8, 256, 512, 2, (512,))
    case = TuneCase(problem, 512, torch.device("cuda"), torch.Generator().manual_seed(0), None, broken)
    timed = tuner._search(case, problem, 3, False, True)
    assert timed and all(backend != QUACK for backend, _, _ in timed)
