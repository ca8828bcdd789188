"""Vendors with one deliberate fault each, installed as a real distribution for the suite to catch.

Each subclasses the CPU reference vendor and breaks exactly one thing; the tests run
`hal conformance` against them in a fresh interpreter and check which tests fail.
"""

from __future__ import annotations

from pathlib import Path

from tests.plugin_dist import write_distribution

SOURCE = '''
import dataclasses

import torch
import torch.nn.functional as F

from hal import DispatchDtype, Int8QuantMode, QuantizedTensor, UnsupportedCapability
from vendors.cpu import CpuVendor


class DropsLastGroup(CpuVendor):
    """Grouped matmul that leaves the rows of the last group at zero."""

    name = "drops-last-group"

    def grouped_matmul(self, x, weight, groups, *, out_dtype=None):
        y = super().grouped_matmul(x, weight, groups, out_dtype=out_dtype)
        last = int(groups.counts()[-1])
        if last:
            y[y.shape[0] - last:] = 0
        return y


class TruncatingFp8(CpuVendor):
    """fp8 quantization that truncates toward zero instead of rounding to nearest."""

    name = "truncating-fp8"

    def quantize(self, x, dtype, *, layout=None, global_scale=None):
        q = super().quantize(x, dtype, layout=layout, global_scale=global_scale)
        if q.dtype is not DispatchDtype.FP8:
            return q
        xf = x.to(torch.float32)
        scale = q.scale.unsqueeze(-1) if q.scale.dim() == xf.dim() - 1 else \\
            q.scale.repeat_interleave(128, dim=-1)[..., : xf.shape[-1]]
        v = xf / torch.where(scale == 0, torch.ones_like(scale), scale)
        truncated = (v.view(torch.int32) & ~0xFFFFF).view(torch.float32)  # keep 3 mantissa bits
        return QuantizedTensor(truncated.to(torch.float8_e4m3fn), q.dtype, q.layout, q.scale)


class RawErrors(CpuVendor):
    """swiglu without input validation: bad input surfaces as torch's own errors."""

    name = "raw-errors"

    def swiglu(self, x):
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]


class Inconsistent(CpuVendor):
    """Declares an int8 -> nvfp4 fallback while carrying neither."""

    name = "inconsistent"

    def _detect_capabilities(self):
        return dataclasses.replace(
            super()._detect_capabilities(),
            dispatch_dtypes=frozenset({DispatchDtype.BF16, DispatchDtype.FP8}),
            dispatch_fallbacks={DispatchDtype.INT8: DispatchDtype.NVFP4, DispatchDtype.NVFP4: None},
            int8_quant_mode=Int8QuantMode.NONE)


class FusedInt8(CpuVendor):
    """Declares fused_deep_moe for W8A8-INT8 and computes it right, token by token."""

    name = "fused-int8"
    uniform_weights = False

    def _detect_capabilities(self):
        return dataclasses.replace(super()._detect_capabilities(), fused_deep_moe=frozenset({"w8a8-int8"}))

    def fused_deep_moe(self, hidden_states, topk_ids, topk_weights, w13, w2, *, scheme, process_group=None,
                       dispatch_dtype=None, max_tokens_per_rank=None):
        if scheme not in self.capabilities().fused_deep_moe:
            raise UnsupportedCapability(f"vendor {self.name!r} declares no fused_deep_moe for {scheme!r}")
        w13f = w13.data.to(torch.float32) * w13.scale.unsqueeze(1)
        w2f = w2.data.to(torch.float32) * w2.scale.unsqueeze(1)
        inter = w2f.shape[1]
        k = topk_ids.shape[1]
        out = torch.zeros(hidden_states.shape, dtype=torch.float32)
        for t in range(hidden_states.shape[0]):
            x = self.dequantize(self.quantize(hidden_states[t:t + 1], DispatchDtype.INT8))
            for j in range(k):
                e = int(topk_ids[t, j])
                h = x @ w13f[e]
                act = self.dequantize(self.quantize(F.silu(h[:, :inter]) * h[:, inter:], DispatchDtype.INT8))
                weight = 1.0 / k if self.uniform_weights else float(topk_weights[t, j])
                out[t] += weight * (act @ w2f[e])[0]
        return out.to(hidden_states.dtype)


class FusedIgnoresWeights(FusedInt8):
    """A fused op that averages the top-k experts instead of applying the routing weights."""

    name = "fused-ignores-weights"
    uniform_weights = True
'''

#: entry-point name -> class in the module above
VENDORS = {
    "drops-last-group": "DropsLastGroup",
    "truncating-fp8": "TruncatingFp8",
    "raw-errors": "RawErrors",
    "inconsistent": "Inconsistent",
    "fused-int8": "FusedInt8",
    "fused-ignores-weights": "FusedIgnoresWeights",
}


def write_faulty_vendors(root: Path) -> Path:
    """A distribution registering every vendor of `VENDORS` in `hal.vendors`."""
    return write_distribution(
        root, "hal-faulty-vendors",
        {"hal.vendors": {name: f"faulty_vendors:{cls}" for name, cls in VENDORS.items()}},
        {"faulty_vendors": SOURCE},
    )
