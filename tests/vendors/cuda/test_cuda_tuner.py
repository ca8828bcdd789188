"""`hal tune`'s search on a CUDA device, through the public `Vendor.tune`: every case gets an entry,
the table reads back, and the chosen configuration computes what the reference computes when the
vendor runs with that table. Skipped without a CUDA device."""

from __future__ import annotations

import json

import pytest
import torch

from hal import GemmKind, GemmProblem, Groups, reference
from vendors.cuda import CudaVendor
from vendors.cuda.tuning import TuningTable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("kind", [GemmKind.BF16, GemmKind.FP8_BLOCK128])
def test_tune_covers_every_case_and_its_choice_computes_the_reference(tmp_path, kind):
    # K and N not multiples of 128; 1 and 300 tokens reach the decode and the many-rows grids.
    problem = GemmProblem(kind, 12, 320, 200, 2, (1, 300))
    table = CudaVendor(tuning=False).tune([problem])
    json.dumps(table)  # JSON-able as `hal tune` writes it
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    loaded = TuningTable.load(path)
    (key,) = loaded.entries
    assert key == f"{kind.value} E=12 K=320 N=200"
    assert sorted(loaded.entries[key]) == [2, 600]
    assert all(c.us is not None and c.us > 0 for c in loaded.entries[key].values())
    assert "CUDA-graph" in loaded.meta["timing"]

    vendor = CudaVendor(tuning=path)
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(12, 320, 200, device="cuda", generator=g) / 320**0.5
    counts = torch.tensor([0, 50, 60, 0, 70, 40, 80, 0, 100, 30, 120, 50], device="cuda")  # 600 rows
    groups = Groups.from_counts(counts)
    x = torch.randn(int(counts.sum()), 320, device="cuda", generator=g)
    if kind is GemmKind.BF16:
        qw = vendor.quantize_weight(w.to(torch.bfloat16), "none", torch.bfloat16)
        act = x.to(torch.bfloat16)
    else:
        qw = vendor.quantize_weight(w, "block-128x128")
        act = vendor.quantize(x, "fp8", layout="per-token-group-128")
    a = (act if isinstance(act, torch.Tensor) else reference.dequantize(act)).double()
    b = reference.dequantize_weight(qw).double()
    exact = torch.cat(
        [a[int(s) : int(s + c)] @ b[e] for e, (s, c) in enumerate(zip(counts.cumsum(0) - counts, counts))]
    )
    got = vendor.grouped_matmul(act, vendor.prepare_weight(qw), groups, out_dtype=torch.bfloat16)
    # one bf16 rounding of the output, plus fp32 accumulation over K = 320
    bound = (2**-8 + 320 * 2**-23) * exact.abs().max()
    assert (got.double() - exact).abs().max() <= bound


def test_a_gate_up_problem_is_tuned_with_its_activation_and_computes_it(tmp_path):
    """A problem with SiLU-GLU gets a `+silu-glu` entry (the epilogue, the plain kernel then the pass, or
    torch._grouped_mm then the pass); the vendor reading it computes silu(gate) * up."""
    from hal import ActivationKind
    from vendors.cuda.tuning import GROUPED_MM, TRITON, TRITON_THEN_ACTIVATION

    problem = GemmProblem(GemmKind.BF16, 12, 320, 400, 2, (1, 300), ActivationKind.SILU_GLU)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(CudaVendor(tuning=False).tune([problem])))
    loaded = TuningTable.load(path)
    assert list(loaded.entries) == ["bf16 E=12 K=320 N=400 +silu-glu"]
    choices = loaded.entries["bf16 E=12 K=320 N=400 +silu-glu"]
    assert sorted(choices) == [2, 600]
    assert {c.backend for c in choices.values()} <= {TRITON, TRITON_THEN_ACTIVATION, GROUPED_MM}

    vendor = CudaVendor(tuning=path)
    g = torch.Generator(device="cuda").manual_seed(2)
    w = (torch.randn(12, 320, 400, device="cuda", generator=g) / 320**0.5).to(torch.bfloat16)
    for counts in ([0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], [0, 50, 60, 0, 70, 40, 80, 0, 100, 30, 120, 50]):
        c = torch.tensor(counts, device="cuda")
        x = torch.randn(int(c.sum()), 320, device="cuda", generator=g).to(torch.bfloat16)
        got = vendor.grouped_matmul(
            x, vendor.quantize_weight(w, "none", torch.bfloat16), Groups.from_counts(c), activation="silu-glu"
        )
        full = torch.cat(
            [x[int(s) : int(s + n)].double() @ w[e].double() for e, (s, n) in enumerate(zip(c.cumsum(0) - c, c))]
        )
        exact = torch.nn.functional.silu(full[:, :200]) * full[:, 200:]
        assert got.shape == (int(c.sum()), 200)
        assert (got.double() - exact).abs().max() <= 2**-6 * exact.abs().max()


def test_the_second_round_tries_bands_of_row_blocks_only_for_many_rows_per_expert():
    from vendors.cuda.kernels.grouped_gemm import TileConfig
    from vendors.cuda.tuner import GROUP_M_CHOICES, GROUP_M_MIN_ROWS_PER_EXPERT, neighbours

    best = TileConfig(128, 128, 128, 8, 3, n_fastest=True)
    few = neighbours(best, GROUP_M_MIN_ROWS_PER_EXPERT - 1)
    many = neighbours(best, GROUP_M_MIN_ROWS_PER_EXPERT)
    assert all(t.group_m == 1 for t in few) and best not in few
    assert {t.group_m for t in many} == {1, *GROUP_M_CHOICES}
    assert [t.as_list() for t in many if t.group_m > 1] == [[128, 128, 128, 8, 3, 1, g] for g in GROUP_M_CHOICES]
    assert all(TileConfig.from_list(t.as_list()) == t for t in many)


def test_the_tma_kernel_is_searched_for_block_scaled_calls_of_many_contiguous_rows():
    """The first round adds the TMA kernel's tiles only where it can run (block-scaled, many rows per expert, rows
    the layer has gathered into a contiguous copy); the second keeps the winner's kernel."""
    from vendors.cuda.kernels.grouped_gemm import TileConfig
    from vendors.cuda.tuner import TMA_GRID, candidates, neighbours

    assert [t for t in candidates(1024, True, True, tma=True) if t.tma] == [
        TileConfig(*c, n_fastest=True, tma=True) for c in TMA_GRID
    ]
    for args in ((1024, True, True, False), (1024, True, False, True), (32, True, True, True), (8, True, True, True)):
        assert not any(t.tma for t in candidates(*args[:3], tma=args[3])), args
    best = TileConfig(128, 64, 128, 4, 3, n_fastest=True, tma=True)
    assert all(t.tma for t in neighbours(best, 4096)) and best not in neighbours(best, 4096)
    assert all(TileConfig.from_list(t.as_list()) == t for t in neighbours(best, 4096))


@pytest.mark.parametrize(
    "kind, tokens", [(GemmKind.BF16, 300), (GemmKind.FP8_BLOCK128, 20), (GemmKind.FP8_BLOCK128, 300)]
)
def test_a_first_projection_is_timed_through_the_dispatch_row_index(kind, tokens):
    """A gate/up problem's calls take the tokens and each routing's row index, as the layer's calls do: every
    backend computes silu(gate) * up of the tokens' rows in expert order, one-byte rows read through the index
    (20 tokens: 40 rows over 12 experts) or gathered first (300 tokens), torch._grouped_mm after a gather."""
    from hal import ActivationKind, DispatchDtype, QuantizedTensor, ScaleLayout
    from vendors.cuda.tune_case import ROUTINGS, TuneCase
    from vendors.cuda.tuning import GROUPED_MM, TRITON, TRITON_THEN_ACTIVATION

    problem = GemmProblem(kind, 12, 320, 512, 2, (tokens,), ActivationKind.SILU_GLU)
    case = TuneCase(problem, tokens, torch.device("cuda"), torch.Generator().manual_seed(0))
    one_byte = kind is GemmKind.FP8_BLOCK128
    assert case.x.shape[0] == tokens and case.through_index == (not one_byte or tokens == 20)
    assert case.both_ways == (one_byte and tokens == 300)  # where the rule gathers, both ways are searched
    if one_byte:
        x = reference.dequantize(QuantizedTensor(case.x, DispatchDtype.FP8, ScaleLayout.GROUP_128, case.x_scale))
        scale = case.w_scale.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :320, :512]
        w = case.w.double() * scale.double()
    else:
        x, w = case.x, case.w.double()
    x = x.double()
    backends = (TRITON, TRITON_THEN_ACTIVATION) + ((GROUPED_MM,) if not one_byte else ())
    for routing in range(ROUTINGS):
        rows, counts = x[case.index[routing].long()], case.counts[routing].tolist()
        ends = torch.tensor(counts).cumsum(0).tolist()
        full = torch.cat([rows[end - c : end] @ w[e] for e, (c, end) in enumerate(zip(counts, ends))])
        exact = torch.nn.functional.silu(full[:, :256]) * full[:, 256:]
        for backend in backends:
            for through_index in (True, False):
                got = case.run((backend, None, through_index), routing, activation=True)
                assert got.shape == exact.shape, backend
                assert (got.double() - exact).abs().max() <= 2**-6 * exact.abs().max(), (backend, routing)


def test_a_first_projection_the_rule_gathers_is_also_timed_through_the_index(tmp_path):
    """fp8 block-128 first projection, 300 tokens x top-2 over 12 experts (50 rows per expert: the built-in rule
    gathers): the search times the Triton kernel both ways, the table says which way won, and the vendor
    reading it computes silu(gate) * up either way."""
    from hal import ActivationKind
    from vendors.cuda.tune_case import TuneCase
    from vendors.cuda.tuner import _search
    from vendors.cuda.tuning import TRITON, TRITON_THEN_ACTIVATION

    problem = GemmProblem(GemmKind.FP8_BLOCK128, 12, 320, 512, 2, (300,), ActivationKind.SILU_GLU)
    case = TuneCase(problem, 300, torch.device("cuda"), torch.Generator().manual_seed(0))
    timed = _search(case, problem, 3, True, False)
    for backend in (TRITON, TRITON_THEN_ACTIVATION):
        assert {c[2] for c in timed if c[0] == backend} == {True, False}, backend
    table = CudaVendor(tuning=False).tune([problem])
    (choice,) = table["entries"]["fp8-block128 E=12 K=320 N=512 +silu-glu"].values()
    assert isinstance(choice["gather"], bool)
    for gather in (True, False):
        choice["gather"] = gather
        path = tmp_path / f"table-{gather}.json"
        path.write_text(json.dumps(table))
        vendor = CudaVendor(tuning=path)
        g = torch.Generator(device="cuda").manual_seed(3)
        x = torch.randn(300, 320, device="cuda", generator=g)
        w = torch.randn(12, 320, 512, device="cuda", generator=g) / 320**0.5
        qw = vendor.quantize_weight(w, "block-128x128")
        q = vendor.quantize(x, "fp8", layout="per-token-group-128")
        picks = torch.rand(300, 12, device="cuda", generator=g).topk(2, dim=1).indices.reshape(-1)
        index = (torch.sort(picks, stable=True).indices // 2).to(torch.int32)
        counts = torch.bincount(picks, minlength=12)
        got = vendor.grouped_matmul(q, qw, Groups.from_counts(counts), activation="silu-glu", row_index=index)
        a = reference.dequantize(q).double()[index.long()]
        b = reference.dequantize_weight(qw).double()
        ends = counts.cumsum(0).tolist()
        full = torch.cat([a[end - c : end] @ b[e] for e, (c, end) in enumerate(zip(counts.tolist(), ends))])
        exact = torch.nn.functional.silu(full[:, :256]) * full[:, 256:]
        assert (got.double() - exact).abs().max() <= 2**-6 * exact.abs().max(), gather
