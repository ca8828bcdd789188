"""The local dispatch hands the experts' first GEMM the tokens and each expert-sorted row's token
(`DispatchOutput.source` / `.row_index`) instead of a gathered copy; the layer computes the same
bits as ops that gather the rows first."""

from __future__ import annotations

import pytest
import torch

import moe
from hal import DispatchConfig, QuantizedTensor, parse_scheme, resolve_dispatch_plan, take_rows
from hal.reference import ReferenceOps
from tests.support.moe_reference import random_weights
from vendors.cpu import CpuVendor

E, H, I, K = 16, 320, 96, 4  # H and I off multiples of 128


class RecordingOps(ReferenceOps):
    """The reference ops, recording the row index of every GEMM that reads its rows through one."""

    def __init__(self):
        super().__init__()
        self.row_indices = []

    def grouped_matmul_gathered(self, x, row_index, weight, groups, *, kind, out_dtype, activation):
        self.row_indices.append(row_index)
        return super().grouped_matmul_gathered(
            x, row_index, weight, groups, kind=kind, out_dtype=out_dtype, activation=activation
        )


class RecordsRowIndex(CpuVendor):
    """The CPU vendor, recording the row index each grouped matmul read its rows through."""

    name = "cpu-records-row-index"

    def _make_ops(self):
        return RecordingOps()


class GathersFirstOps(ReferenceOps):
    """The reference ops computing a GEMM over indexed rows as a gather, the plain GEMM, then the activation."""

    def grouped_matmul_gathered(self, x, row_index, weight, groups, *, kind, out_dtype, activation):
        y = self.grouped_matmul(take_rows(x, row_index), weight, groups, kind=kind, out_dtype=out_dtype)
        return y if activation is None else self.activate(y, activation=activation)


class GathersFirst(CpuVendor):
    name = "cpu-gathers-first"

    def _make_ops(self):
        return GathersFirstOps()


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g).to(torch.bfloat16), torch.randn(tokens, E, generator=g)


@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-int8", "w8a8-fp8-block", "w4a4-int4"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_the_first_gemm_reads_the_tokens_through_the_dispatch_index(scheme, tokens):
    w13, w2 = random_weights(E, H, I, 53)
    x, logits = _inputs(tokens, 54)
    recording = RecordsRowIndex()
    y = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=recording)(x, logits)
    [first] = recording.ops.row_indices  # the second projection reads its rows as they are
    assert first.numel() == tokens * K
    assert torch.equal(torch.bincount(first, minlength=tokens), torch.full((tokens,), K))  # each token k times
    gathered = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=GathersFirst())(x, logits)
    assert torch.equal(y, gathered)


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_through_the_index_at_a_realistic_shape(top_k):
    """128 experts, 1500 tokens, H and I off multiples of 128: the layer reading through the index computes the
    same bits as the layer that gathers first, and the index holds each token k times."""
    experts, hidden, inter, tokens = 128, 1000, 360, 1500
    gen = torch.Generator().manual_seed(top_k)
    w13 = torch.randn(experts, hidden, 2 * inter, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, inter, hidden, generator=gen) / inter**0.5
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen)
    recording = RecordsRowIndex()
    y = moe.MoELayer.from_float(w13, w2, top_k, scheme="w8a8-fp8-block", vendor=recording)(x, logits)
    [index] = recording.ops.row_indices
    assert torch.equal(torch.bincount(index, minlength=tokens), torch.full((tokens,), top_k))
    gathered = moe.MoELayer.from_float(w13, w2, top_k, scheme="w8a8-fp8-block", vendor=GathersFirst())(x, logits)
    assert torch.equal(y, gathered)


def test_the_payload_is_the_rows_sorted_by_expert_gathered_once():
    """Runners that read `payload` get the `[T*k, H]` rows sorted by expert, token order within one."""
    vendor, tokens = CpuVendor(), 9
    plan = resolve_dispatch_plan(
        vendor, H, config=DispatchConfig(dtype="fp8"), scheme=parse_scheme("w8a8-fp8-block"), environ={}
    )
    x, logits = _inputs(tokens, 55)
    weights, ids = torch.softmax(logits, -1).topk(K)
    out = moe.LocalDispatcher(plan, E, vendor=vendor).dispatch(
        x, moe.Routing(ids, weights), lambda rows: vendor.quantize(rows, plan.resolved, layout=plan.scale_layout)
    )
    token_of_row = torch.div(torch.sort(ids.flatten(), stable=True).indices, K, rounding_mode="floor")
    assert torch.equal(out.row_index, token_of_row) and out.source.data.shape == (tokens, H)
    payload = out.payload
    assert isinstance(payload, QuantizedTensor) and payload.data.shape == (tokens * K, H)
    assert torch.equal(payload.data.view(torch.uint8), out.source.data[token_of_row].view(torch.uint8))
    assert torch.equal(payload.scale, out.source.scale[token_of_row])
    assert out.payload is payload


class CountingSortOps(ReferenceOps):
    """The reference ops, recording each sort the layer asks for: "tokens" (with the token of each row) or
    "plain"."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def sort_by_expert(self, topk_ids, *, num_experts):
        self.calls.append("plain")
        return super().sort_by_expert(topk_ids, num_experts=num_experts)

    def sort_by_expert_tokens(self, topk_ids, *, num_experts):
        self.calls.append("tokens")
        order, inverse, counts = ReferenceOps.sort_by_expert(self, topk_ids, num_experts=num_experts)
        return order, inverse, counts, torch.div(order, topk_ids.shape[-1], rounding_mode="floor")


class CountsSorts(CpuVendor):
    name = "cpu-counts-sorts"

    def _make_ops(self):
        return CountingSortOps()


@pytest.mark.parametrize("tokens", [1, 33])
def test_the_dispatch_takes_the_row_index_from_the_sort(tokens):
    """One sort call gives the rows' tokens (no division after it), and the layer computes the same bits as the
    plain CPU vendor's."""
    w13, w2 = random_weights(E, H, I, 57)
    x, logits = _inputs(tokens, 58)
    counting = CountsSorts()
    y = moe.MoELayer.from_float(w13, w2, K, vendor=counting)(x, logits)
    assert counting.ops.calls == ["tokens"]
    plain = moe.MoELayer.from_float(w13, w2, K, vendor=CpuVendor())(x, logits)
    assert torch.equal(y, plain)
