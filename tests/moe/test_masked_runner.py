"""The generic runner on the masked low-latency layout `[L, slots, H]` (a vendor dispatcher's, e.g. DeepEP's):
only the valid rows are computed, each equals the same row computed on its own, and empty slots are zero."""

from __future__ import annotations

import pytest
import torch

import hal
import moe
from moe.dispatch import DispatchFormat, DispatchOutput
from moe.runners import run_grouped_experts


@pytest.mark.parametrize("scheme, dtype", [("unquantized", "bf16"), ("w8a8-fp8-block", "fp8"), ("w8a8-int8", "int8")])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [6, 6, 6, 6]], ids=["mixed", "empty", "full"])
def test_masked_rows_equal_the_rows_computed_alone(scheme: str, dtype: str, counts: list[int]) -> None:
    vendor = hal.get_vendor("cpu")
    local, slots, hidden, inter = 4, 6, 136, 40
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(local, hidden, 2 * inter, generator=g) / hidden**0.5
    w2 = torch.randn(local, inter, hidden, generator=g) / inter**0.5
    layer = moe.MoELayer.from_float(w13, w2, 2, scheme=scheme, vendor=vendor, dispatch=hal.DispatchConfig(dtype=dtype))
    x = torch.randn(local * slots, hidden, generator=g).to(torch.bfloat16)
    quantize = layer.scheme.dispatch_quantizer(vendor, layer.plan, layer.expert_weights)
    q = quantize(x)
    scale = None if q.scale is None else q.scale.reshape(local, slots, *q.scale.shape[1:])
    masked = hal.QuantizedTensor(q.data.reshape(local, slots, hidden), q.dtype, q.layout, scale, q.global_scale)
    count = torch.tensor(counts, dtype=torch.int64)
    out = run_grouped_experts(
        vendor, layer.scheme, layer.expert_weights, DispatchOutput(DispatchFormat.EP_LOW_LATENCY, masked, count)
    )
    assert tuple(out.shape) == (local, slots, hidden)
    for e, n in enumerate(counts):
        assert not out[e, n:].any(), f"expert {e}: empty slots are not zero"
        for j in range(n):  # one row through the expert on its own: a one-row group
            row = q.rows(torch.tensor([e * slots + j]))
            alone = torch.zeros(local, dtype=torch.int64)
            alone[e] = 1
            want = run_grouped_experts(
                vendor, layer.scheme, layer.expert_weights, DispatchOutput(DispatchFormat.STANDARD, row, alone)
            )
            torch.testing.assert_close(out[e, j], want[0], rtol=0, atol=0)
