"""DeepGEMM as the fp8 block-128 runner: which calls it takes, the aligned layout its contiguous GEMM reads, and
the rows coming back in order (no GPU: DeepGEMM's psum-layout contract is played by a float64 stand-in)."""

from __future__ import annotations

import importlib.util
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from hal import DispatchDtype, GemmKind, InvalidInput, QuantizedTensor, QuantizedWeight, ScaleLayout
from vendors.cpu import CpuVendor
from vendors.cuda.deep_gemm_runner import (
    ALIGN_ROWS,
    DEEP_GEMM_MIN_ROWS_PER_GROUP,
    DEEP_GEMM_MIN_WEIGHT_ELEMENTS,
    aligned_layout,
    deep_gemm_fits,
    deep_gemm_grouped,
    deep_gemm_or_fallback,
    find_deep_gemm,
    missing_api,
    wants_deep_gemm,
)
from vendors.cuda.torch_grouped import log_unserved_choice
from vendors.cuda.tuning import DEEP_GEMM, FORMAT, Choice, TuningTable


def _expand(scale: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    return scale.repeat_interleave(ALIGN_ROWS, dim=dim).narrow(dim, 0, size)


class _PsumGemm:
    """DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous` with `use_psum_layout=True`, as its API states it: group g's
    rows run from its end `ends[g-1]` rounded up to 128 to `ends[g]`; other rows of `d` are left alone."""

    def __init__(self, align: int | None = None) -> None:
        self.calls = 0
        self.align = align or ALIGN_ROWS
        if align is not None:  # the module's setter moved it: the runner must ask
            self.get_mk_alignment_for_contiguous_layout = lambda: align

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, ends, *, use_psum_layout):
        assert use_psum_layout and ends.dtype == torch.int32
        (a_data, a_scale), (b_data, b_scale) = a, b
        k = a_data.shape[1]
        assert b_data.stride(2) == 1 and a_data.shape[0] == d.shape[0] == a_scale.shape[0]
        x = a_data.double() * _expand(a_scale.double(), 1, k)
        w = b_data.double() * _expand(_expand(b_scale.double(), 1, b_data.shape[1]), 2, k)  # [E, N, K]
        end = 0
        for g, group_end in enumerate(ends.tolist()):
            start = -(-end // self.align) * self.align
            assert group_end >= start
            d[start:group_end] = (x[start:group_end] @ w[g].T).to(d.dtype)
            end = group_end
        self.calls += 1


def _block_fp8(e: int, k: int, n: int, *, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, k, n, generator=gen) / k**0.5
    q = CpuVendor().quantize_weight(w, "block-128x128", torch.float8_e4m3fn)
    k_major = q.data.transpose(1, 2).contiguous().transpose(1, 2)  # as CudaOps.prepare_weight stores it
    deq = q.data.double() * _expand(_expand(q.scale.double(), 1, k), 2, n)
    return QuantizedWeight(k_major, q.layout, q.scale), deq


def _rows(t: int, k: int, *, seed: int) -> tuple[QuantizedTensor, torch.Tensor]:
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    q = CpuVendor().quantize(x, "fp8", layout="per-token-group-128")
    return q, q.data.double() * _expand(q.scale.double(), 1, k)


def _routing(tokens: int, experts: int, top_k: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing's rows per expert and the token of each row sorted by expert (the dispatch's row index)."""
    picks = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)).topk(top_k, dim=1).indices
    picks = picks.flatten()
    return torch.bincount(picks, minlength=experts), torch.sort(picks, stable=True).indices // top_k


@pytest.mark.parametrize(
    "experts, top_k, tokens, k, n, gathered",
    [
        (4, 1, 7, 128, 256, False),
        (16, 2, 300, 256, 384, True),
        (64, 8, 1000, 384, 256, True),
        (8, 4, 2, 128, 128, True),
    ],
)
def test_the_aligned_layout_round_trip_equals_the_float64_grouped_product(experts, top_k, tokens, k, n, gathered):
    gen = torch.Generator().manual_seed(experts + tokens)
    picks = torch.randn(tokens, experts, generator=gen).topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(picks, minlength=experts)
    order = torch.sort(picks, stable=True).indices
    rows = picks.numel()
    x, x64 = _rows(tokens if gathered else rows, k, seed=1)
    row_index = order // top_k if gathered else None
    weight, w64 = _block_fp8(experts, k, n, seed=2)
    stand_in = _PsumGemm()
    y = deep_gemm_grouped(stand_in, x, weight, counts, row_index)  # type: ignore[arg-type]
    source_rows = x64[row_index] if gathered else x64
    groups = torch.repeat_interleave(torch.arange(experts), counts)
    want = torch.stack([source_rows[r] @ w64[groups[r]] for r in range(rows)])
    assert stand_in.calls == 1 and y.shape == (rows, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), want, rtol=1.6e-2, atol=1e-2)


def test_a_gated_call_activates_the_aligned_product_through_the_place_of_each_sorted_row():
    experts, top_k, tokens, k, n = 64, 8, 700, 256, 2 * 384  # realistic routing; I = 384, not a power of two
    counts, row_index = _routing(tokens, experts, top_k, seed=3)
    x, x64 = _rows(tokens, k, seed=4)
    weight, w64 = _block_fp8(experts, k, n, seed=5)
    seen = []

    def swiglu_through(product: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        seen.append(product.shape[0])
        gate, up = product[rows].double().chunk(2, dim=-1)
        return gate * torch.sigmoid(gate) * up

    y = deep_gemm_grouped(_PsumGemm(), x, weight, counts, row_index, finish=swiglu_through)  # type: ignore[arg-type]
    product = torch.cat([part @ w64[e] for e, part in enumerate(x64[row_index].split(counts.tolist()))])
    gate, up = product.chunk(2, dim=-1)
    assert seen[0] > row_index.numel()  # the activation read the aligned buffer, not a gathered copy
    torch.testing.assert_close(y, gate * torch.sigmoid(gate) * up, rtol=3e-2, atol=2e-2)


@pytest.mark.parametrize("padding", [1, 127, 3000])
def test_padding_rows_past_the_groups_leave_every_grouped_row_exact(padding):
    """A masked layout hands over counts summing to fewer rows than it passes (the rest: empty slots). Those
    rows go after the last group, never onto a group's row, and the grouped rows stay exact."""
    experts, k, n = 32, 256, 384
    counts = torch.bincount(
        torch.randint(0, experts, (900,), generator=torch.Generator().manual_seed(8)), minlength=experts
    )
    counts[5] = 0
    total = int(counts.sum())
    rows = total + padding
    source, place, ends = aligned_layout(counts, rows)
    assert len(set(place.tolist())) == rows and int(place.max()) < source.numel()
    assert bool((place[total:] >= ends[-1]).all())
    x, x64 = _rows(rows, k, seed=9)
    weight, w64 = _block_fp8(experts, k, n, seed=10)
    y = deep_gemm_grouped(_PsumGemm(), x, weight, counts, None)  # type: ignore[arg-type]
    want = torch.cat([part @ w64[e] for e, part in enumerate(x64[:total].split(counts.tolist()))])
    assert y.shape == (rows, n)
    torch.testing.assert_close(y[:total].double(), want, rtol=1.6e-2, atol=1e-2)


def test_the_layout_follows_the_alignment_the_module_reports():
    experts, top_k, tokens, k, n = 8, 2, 300, 128, 128
    counts, row_index = _routing(tokens, experts, top_k, seed=5)
    x, x64 = _rows(tokens, k, seed=6)
    weight, w64 = _block_fp8(experts, k, n, seed=7)
    want = torch.cat([part @ w64[e] for e, part in enumerate(x64[row_index].split(counts.tolist()))])
    for align in (64, 256):
        y = deep_gemm_grouped(_PsumGemm(align), x, weight, counts, row_index)  # type: ignore[arg-type]
        torch.testing.assert_close(y.double(), want, rtol=1.6e-2, atol=1e-2)


def test_the_aligned_layout_starts_every_group_at_a_multiple_of_128_and_reads_each_row_once():
    counts = torch.tensor([0, 129, 1, 0, 256, 3])
    row_index = torch.randperm(int(counts.sum()), generator=torch.Generator().manual_seed(0))
    source, place, ends = aligned_layout(counts, row_index.numel(), row_index)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends[:-1].long()])
    aligned_starts = (starts + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
    assert torch.equal(ends.long() - aligned_starts, counts)
    assert len(set(place.tolist())) == place.numel()
    assert torch.equal(source[place], row_index)
    assert source.numel() % ALIGN_ROWS == 0 and source.numel() >= int(ends[-1])


@pytest.mark.parametrize(
    "change, fits",
    [
        ({}, True),
        ({"kind": GemmKind.FP8_ROWWISE}, False),
        ({"out_dtype": torch.float16}, False),
        ({"k": 192}, False),
        ({"n": 200}, False),
        ({"n_major": True}, False),
        ({"bf16_rows": True}, False),
    ],
)
def test_deep_gemm_takes_k_major_block_128_fp8_with_k_and_n_multiples_of_128_only(change, fits):
    k, n = change.get("k", 256), change.get("n", 384)
    data = torch.zeros(4, n, k, dtype=torch.float8_e4m3fn).transpose(1, 2)
    if change.get("n_major"):
        data = data.contiguous()
    weight = QuantizedWeight(data, ScaleLayout.BLOCK_128X128, torch.ones(4, -(-k // 128), -(-n // 128)))
    x: torch.Tensor | QuantizedTensor = QuantizedTensor(
        torch.zeros(10, k, dtype=torch.float8_e4m3fn),
        DispatchDtype.FP8,
        ScaleLayout.GROUP_128,
        torch.ones(10, -(-k // 128)),
    )
    if change.get("bf16_rows"):
        x = torch.zeros(10, k, dtype=torch.bfloat16)
    kind = change.get("kind", GemmKind.FP8_BLOCK128)
    assert deep_gemm_fits(x, weight, kind, change.get("out_dtype", torch.bfloat16)) is fits


def test_the_table_decides_where_it_has_an_entry_and_the_rows_per_expert_elsewhere():
    least = DEEP_GEMM_MIN_ROWS_PER_GROUP
    deep, triton = (
        Choice.from_dict({"backend": DEEP_GEMM}, "t"),
        Choice.from_dict({"backend": "triton", "tiles": [64, 64, 64, 4, 3]}, "t"),
    )
    big, small = (7168, 4096), (2048, 1536)  # deepseek-v3's gate/up, qwen3's
    assert DEEP_GEMM_MIN_WEIGHT_ELEMENTS <= big[0] * big[1] and small[0] * small[1] < DEEP_GEMM_MIN_WEIGHT_ELEMENTS
    assert wants_deep_gemm(None, GemmKind.FP8_BLOCK128, least * 8, 8, *big)
    assert not wants_deep_gemm(None, GemmKind.FP8_BLOCK128, least * 8 - 1, 8, *big)
    assert not wants_deep_gemm(None, GemmKind.FP8_BLOCK128, least * 100, 8, *small)
    assert wants_deep_gemm(deep, GemmKind.FP8_BLOCK128, 16, 8, *small)
    assert not wants_deep_gemm(triton, GemmKind.FP8_BLOCK128, least * 100, 8, *big)
    assert not wants_deep_gemm(None, GemmKind.FP8_ROWWISE, least * 100, 8, *big)
    assert wants_deep_gemm(deep, GemmKind.BF16, 16, 8, *big)  # asked for: the vendor then finds it cannot serve
    assert not wants_deep_gemm(deep, GemmKind.FP8_BLOCK128, 0, 8, *big)


def test_a_table_naming_an_unknown_backend_is_refused_with_the_names_it_takes():
    with pytest.raises(InvalidInput, match="deep-gemm"):
        Choice.from_dict({"backend": "deepgemm"}, "entry")


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_deep_gemm_is_not_used_off_sm90_and_the_note_says_why(capability):
    module, note = find_deep_gemm(capability)
    assert module is None and f"sm{capability[0]}{capability[1]}" in note


@pytest.mark.skipif(importlib.util.find_spec("deep_gemm") is not None, reason="DeepGEMM is installed here")
def test_an_absent_deep_gemm_is_named_with_how_to_install_it():
    module, note = find_deep_gemm((9, 0))
    assert module is None and "not installed" in note and "docs/deep-gemm.md" in note


def test_a_table_choice_deep_gemm_cannot_serve_is_logged_once_per_problem(caplog):
    weight = QuantizedWeight(
        torch.zeros(4, 128, 128, dtype=torch.float8_e4m3fn), ScaleLayout.BLOCK_128X128, torch.ones(4, 1, 1)
    )
    logged: set = set()
    with caplog.at_level(logging.WARNING, logger="vendors.cuda.torch_grouped"):
        for _ in range(3):
            log_unserved_choice(logged, GemmKind.FP8_BLOCK128, weight, torch.bfloat16, DEEP_GEMM)
        log_unserved_choice(logged, GemmKind.FP8_BLOCK128, weight, torch.bfloat16)
    assert len(caplog.records) == 2 and "deep-gemm" in caplog.records[0].getMessage()


def test_no_rows_make_no_call():
    stand_in = SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=None)  # would fail if called
    x = QuantizedTensor(
        torch.zeros(0, 128, dtype=torch.float8_e4m3fn), DispatchDtype.FP8, ScaleLayout.GROUP_128, torch.ones(0, 1)
    )
    weight, _ = _block_fp8(2, 128, 128, seed=0)
    y = deep_gemm_grouped(stand_in, x, weight, torch.zeros(2, dtype=torch.int64), None)  # type: ignore[arg-type]
    assert y.shape == (0, 128)


def test_a_deep_gemm_without_the_psum_layout_is_named_as_too_old():
    def gemm(a, b, d, grouped_layout, use_psum_layout=False):
        """m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout, use_psum_layout: bool = False) -> None"""

    def old_gemm(a, b, d, m_indices):
        """m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices) -> None"""

    assert missing_api(SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=gemm)) is None
    assert "use_psum_layout" in missing_api(SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=old_gemm))
    assert "no m_grouped" in missing_api(SimpleNamespace())


def test_a_deep_gemm_entry_keeps_the_choice_it_replaced_and_the_table_reads_it_back(tmp_path):
    triton = Choice("triton", (64, 128, 128, 8, 3, 1), 496.9, 662.0, gather=True)
    table = TuningTable(
        "NVIDIA H200", {"fp8-block128 E=8 K=4096 N=28672 +silu-glu": {8192: Choice(DEEP_GEMM, fallback=triton)}}
    )
    path = tmp_path / "table.json"
    table.write(path)
    (read,) = TuningTable.load(path).entries["fp8-block128 E=8 K=4096 N=28672 +silu-glu"].values()
    assert read == Choice(DEEP_GEMM, fallback=triton)


@pytest.mark.parametrize("fallback", [{"backend": "deep-gemm"}, {"backend": "triton", "tiles": [0]}, {"backend": "x"}])
def test_a_deep_gemm_fallback_that_is_itself_deep_gemm_or_malformed_is_refused(tmp_path, fallback):
    path = tmp_path / "table.json"
    entry = {"backend": "deep-gemm", "fallback": fallback}
    table = {"format": FORMAT, "device": "NVIDIA H200", "entries": {"fp8-block128 E=8 K=256 N=256": {"64": entry}}}
    path.write_text(json.dumps(table))
    with pytest.raises(InvalidInput, match="M=64 fallback|fallback must name"):
        TuningTable.load(path)


def test_a_deep_gemm_entry_that_cannot_run_gives_way_to_its_fallback_logged_once(caplog):
    weight, _ = _block_fp8(8, 256, 256, seed=0)
    x, _ = _rows(4096, 256, seed=1)
    triton = Choice("triton", (64, 128, 128, 8, 3, 1), 1.0, 2.0)
    entry = Choice(DEEP_GEMM, fallback=triton)
    logged: set = set()
    args = (x, weight, GemmKind.FP8_BLOCK128, torch.bfloat16, 4096, 8, logged)
    with caplog.at_level(logging.INFO, logger="vendors.cuda"):
        for _ in range(3):  # not installed: its fallback, one info line
            assert deep_gemm_or_fallback(None, entry, *args) == (False, triton)
        assert deep_gemm_or_fallback(_PsumGemm(), entry, *args) == (True, entry)
        assert deep_gemm_or_fallback(_PsumGemm(), None, *args) == (False, None)  # the rule: small experts, no log
        bf16 = torch.zeros(4096, 256, dtype=torch.bfloat16)  # installed, operands it does not take: a warning
        assert deep_gemm_or_fallback(_PsumGemm(), Choice(DEEP_GEMM), bf16, *args[1:-1], set()) == (False, None)
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.INFO, logging.WARNING], caplog.text
    assert "fallback entry (triton)" in caplog.records[0].getMessage()
