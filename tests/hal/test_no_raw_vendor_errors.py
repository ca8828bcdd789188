"""Input that reaches a vendor's own ops only where hal's checks let it through is refused by hal with
`InvalidInput`, for every vendor (here the CPU and the emulated Ascend vendor, which does not run in
step with the host): group lists whose numbers do not fit the rows, a process group that is not one,
expert rows of another shape than the dispatch gave, a handle that is not the dispatch's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import hal
from hal import DispatchDtype, Groups, InvalidInput, QuantizedTensor, ScaleLayout, checks
from hal.reference import ReferenceOps
from tests.support.refusals import refused
from vendors.cpu import CpuVendor

VENDORS = ["cpu", "ascend-emulated"]
E, H, N = 3, 64, 32


@pytest.fixture(params=VENDORS)
def vendor(request) -> hal.Vendor:
    return hal.get_vendor(request.param)


def _operands(vendor: hal.Vendor, kind: str):
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w = torch.randn(E, H, N, generator=torch.Generator().manual_seed(1)) / 8
    if kind == "int8":
        return vendor.quantize(x, "int8"), vendor.quantize_weight(w, ScaleLayout.PER_CHANNEL, torch.int8)
    return x, vendor.quantize_weight(w, ScaleLayout.NONE, torch.bfloat16)


GROUP_LISTS = {
    "counts-long": (Groups.from_counts, [2, 2, 3], "at most the 5 rows"),
    "counts-negative": (Groups.from_counts, [3, -1, 3], "non-negative counts"),
    "offsets-decreasing": (Groups.from_offsets, [3, 2, 5], "non-decreasing offsets"),
    "offsets-long": (Groups.from_offsets, [1, 2, 9], "at most the 5 rows"),
}


@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("case", GROUP_LISTS)
def test_group_lists_that_do_not_fit_the_rows_are_refused(vendor, case, kind):
    make, values, shown = GROUP_LISTS[case]
    x, w = _operands(vendor, kind)
    groups = make(torch.tensor(values))
    assert shown in refused(lambda: vendor.grouped_matmul(x, w, groups), "groups")
    for extra in ({"activation": "silu-glu"}, {"bias": torch.ones(E, N)}, {"row_index": torch.arange(5)}):
        refused(lambda: vendor.grouped_matmul(x, w, groups, **extra), "groups")
    good = vendor.grouped_matmul(x, w, Groups.from_counts(torch.tensor([2, 2, 1])))
    assert good.shape == (5, N) and bool(torch.isfinite(good).all())


def test_a_vendor_declaring_padding_takes_groups_covering_fewer_rows():
    counts = Groups.from_counts(torch.tensor([2, 1, 1]))
    checks.group_values(counts, 5, padding=True)
    with pytest.raises(InvalidInput, match="at most the 5 rows"):
        checks.group_values(Groups.from_counts(torch.tensor([2, 2, 3])), 5, padding=True)
    checks.group_values(counts, 5, padding=False)


# -- process groups ----------------------------------------------------------------------------------


def _int8_weights(vendor: hal.Vendor, experts: int = 8):
    w13 = vendor.quantize_weight(torch.ones(experts, H, 2 * N) / 8, ScaleLayout.PER_CHANNEL, torch.int8)
    w2 = vendor.quantize_weight(torch.ones(experts, N, H) / 8, ScaleLayout.PER_CHANNEL, torch.int8)
    return w13, w2


NOT_GROUPS = ["group", 3, object(), torch.ones(1)]


@pytest.mark.parametrize("group", NOT_GROUPS, ids=["str", "int", "object", "tensor"])
def test_an_object_that_is_not_a_process_group_is_refused(vendor, group):
    x, ids = torch.ones(5, H, dtype=torch.bfloat16), torch.tensor([[0, 1]] * 5)
    w13, w2 = _int8_weights(vendor)
    scheme = "w8a8-int8"
    refused(
        lambda: vendor.fused_deep_moe(x, ids, torch.ones(5, 2), w13, w2, scheme=scheme, process_group=group),
        "process_group",
    )
    refused(lambda: vendor.prepare_fused(w13, w2, scheme=scheme, process_group=group), "process_group")
    for name in ("mc2", "deepep"):
        common = {"dtype": "bf16", "num_experts": 8, "process_group": group}
        refused(lambda: vendor.ep_dispatch(x, ids, name=name, **common), "process_group")
        refused(lambda: vendor.prepare_ep(name, hidden_size=H, capacity=None, **common), "process_group")


def test_none_is_a_process_group_only_where_one_rank_is_meant():
    checks.process_group(None, optional=True)
    for value in (None, dist.ProcessGroupGloo(dist.HashStore(), 0, 1)):  # a backend is not a group
        with pytest.raises(InvalidInput, match="process_group"):
            checks.process_group(value, optional=False)


# -- the expert-parallel combine takes what its dispatch gave -------------------------------------------


@pytest.fixture
def world():
    """A one-rank gloo world (the process's default group), destroyed afterwards."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class _LoopbackOps(ReferenceOps):
    """An expert-parallel dispatcher on one rank: every pair's row, in pair order (or masked per expert)."""

    def ep_dispatch(self, x, topk_ids, *, name, dtype, num_experts, process_group, topk_weights, capacity, layout):
        rows = x.repeat_interleave(topk_ids.shape[1], dim=0)
        counts = torch.bincount(topk_ids.reshape(-1), minlength=num_experts)
        if capacity is not None:
            rows = rows.new_zeros((num_experts, capacity, x.shape[1]))
        return QuantizedTensor(rows, DispatchDtype.BF16, ScaleLayout.NONE), counts, ("loopback", capacity)

    def ep_combine(self, rows, topk_weights, handle, *, name, out_dtype):
        assert handle[0] == "loopback"  # the vendor receives its own handle back
        if rows.dim() == 3:
            return torch.zeros(topk_weights.shape[0], rows.shape[-1], dtype=out_dtype)
        k = topk_weights.shape[1]
        return (rows.float().view(-1, k, rows.shape[-1]) * topk_weights.unsqueeze(-1)).sum(1).to(out_dtype)


class LoopbackVendor(CpuVendor):
    name = "cpu-loopback-ep"

    def _detect_capabilities(self):
        caps = super()._detect_capabilities()
        return dataclasses.replace(caps, ep_dispatchers=frozenset({"loop"}), ep_low_latency=frozenset({"loop"}))

    def _make_ops(self):
        return _LoopbackOps()


def test_the_combine_refuses_rows_weights_and_handles_its_dispatch_did_not_give(world):
    vendor, group = LoopbackVendor(), world
    x, ids, weights = (
        torch.randn(4, H).to(torch.bfloat16),
        torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]),
        torch.rand(4, 2),
    )
    common = {"name": "loop", "dtype": "bf16", "num_experts": 8, "process_group": group, "topk_weights": weights}
    payload, _, handle = vendor.ep_dispatch(x, ids, **common)
    rows = payload.data
    out = vendor.ep_combine(rows, weights, handle, name="loop", out_dtype=torch.float32)
    want = (x.float().unsqueeze(1) * weights.unsqueeze(-1)).sum(1)
    assert torch.allclose(out, want, rtol=1e-2, atol=1e-2)
    combine = vendor.ep_combine
    refused(lambda: combine(rows.view(2, 4, H), weights, handle, name="loop", out_dtype=torch.float32), "rows")
    refused(lambda: combine(rows[:3], weights, handle, name="loop", out_dtype=torch.float32), "rows")
    refused(lambda: combine(rows, weights[:3], handle, name="loop", out_dtype=torch.float32), "topk_weights")
    refused(lambda: combine(rows, weights, None, name="loop", out_dtype=torch.float32), "handle")
    refused(lambda: combine(rows, weights, ("loopback", None), name="loop", out_dtype=torch.float32), "handle")
    masked, _, low = vendor.ep_dispatch(x, ids, capacity=4, **common)
    assert masked.data.dim() == 3 and combine(
        masked.data, weights, low, name="loop", out_dtype=torch.float32
    ).shape == (4, H)
    refused(lambda: combine(masked.data.reshape(-1, H), weights, low, name="loop", out_dtype=torch.float32), "rows")


def test_the_mc2_combine_takes_only_what_its_dispatch_gave(world):
    """The emulated Ascend MC2 dispatcher (hidden 7168 as the op takes it) on a one-rank gloo world."""
    vendor, group = hal.get_vendor("ascend-emulated"), world
    if "mc2" not in vendor.capabilities().ep_dispatchers:
        pytest.skip("the emulated vendor declares no mc2 here")
    hidden = 7168
    x, ids, weights = (
        torch.randn(4, hidden).to(torch.bfloat16),
        torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]),
        torch.rand(4, 2),
    )
    payload, _, handle = vendor.ep_dispatch(x, ids, name="mc2", dtype="bf16", num_experts=8, process_group=group)
    assert torch.equal(
        vendor.ep_combine(payload.data, torch.ones(4, 2), handle, name="mc2", out_dtype=torch.float32), 2 * x.float()
    )
    rows = payload.data
    combine = vendor.ep_combine
    refused(lambda: combine(rows.view(2, -1, hidden), weights, handle, name="mc2", out_dtype=torch.bfloat16), "rows")
    refused(lambda: combine(rows, weights[:3], handle, name="mc2", out_dtype=torch.bfloat16), "topk_weights")
    refused(lambda: combine(rows, weights, None, name="mc2", out_dtype=torch.bfloat16), "handle")
