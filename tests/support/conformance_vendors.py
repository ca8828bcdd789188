"""Vendors with one deliberate fault each, installed as a real distribution for the suite to catch.

Each subclasses the CPU reference vendor and breaks exactly one thing; the tests run
`hal conformance` against them in a fresh interpreter and check which tests fail.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.plugin_dist import write_distribution

SOURCE = '''
import dataclasses

import torch
import torch.nn.functional as F

from hal import DispatchDtype, Int8QuantMode, QuantizedTensor, QuantizedWeight, ScaleLayout, UnsupportedCapability
from vendors.cpu import CpuVendor


class DropsLastGroup(CpuVendor):
    """Grouped matmul that leaves the rows of the last group at zero."""

    name = "drops-last-group"

    def grouped_matmul(self, x, weight, groups, *, out_dtype=None, activation=None):
        y = super().grouped_matmul(x, weight, groups, out_dtype=out_dtype)
        last = int(groups.counts()[-1])
        if last:
            y[y.shape[0] - last:] = 0
        return y if activation is None else self.activate(y, activation)


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


# -- faults only realistic shapes show (tests/conformance/test_conformance_catches_shape_faults.py) ----------------


def _experts(weight, index):
    """The weight with its experts taken in the order of `index`."""
    def pick(t):
        return None if t is None or t.dim() == 0 else t[index.to(t.device)]
    return QuantizedWeight(weight.data[index.to(weight.data.device)], weight.layout, pick(weight.scale),
                           pick(weight.global_scale))


class SixteenGroups(CpuVendor):
    """A grouped matmul whose expert table holds 16 entries: group g >= 16 uses expert g % 16's weights."""

    name = "sixteen-groups"

    def grouped_matmul(self, x, weight, groups, *, out_dtype=None, bias=None, activation=None):
        count = getattr(groups, "num_groups", 0)  # bad arguments go on to the checks unchanged
        if count > 16 and isinstance(weight, QuantizedWeight) and weight.num_experts == count:
            weight = _experts(weight, torch.arange(count) % 16)
        return super().grouped_matmul(x, weight, groups, out_dtype=out_dtype, bias=bias, activation=activation)


class TailColumnsUnwritten(CpuVendor):
    """A weight quantizer working in 128-column tiles that never writes a partial last tile: when N is
    not a multiple of 128, the last N % 128 columns come out zero (scaled layouts only)."""

    name = "tail-columns-unwritten"

    def quantize_weight(self, weight, layout, dtype=None):
        q = super().quantize_weight(weight, layout, dtype)
        n = weight.shape[2]
        if q.layout is ScaleLayout.NONE or n % 128 == 0:
            return q
        first = (n - n % 128) // (8 if q.is_int4 else 1)  # int4: eight columns per int32 word
        data = q.data.clone()
        (data.view(torch.uint8) if data.element_size() == 1 else data)[..., first:] = 0
        return QuantizedWeight(data, q.layout, q.scale, q.global_scale)


class CombineWraps256(CpuVendor):
    """A combine whose weights are read through a 256-token window: token t >= 256 gets the routing
    weights of token t % 256."""

    name = "combine-wraps-256"

    def weighted_combine(self, rows, index, topk_weights, out_dtype):
        tokens = topk_weights.shape[0]
        if tokens > 256:
            topk_weights = topk_weights[torch.arange(tokens, device=topk_weights.device) % 256]
        return super().weighted_combine(rows, index, topk_weights, out_dtype)


class TopOneUnweighted(CpuVendor):
    """A combine whose top-1 fast path copies each token's row without applying its routing weight."""

    name = "top1-unweighted"

    def weighted_combine(self, rows, index, topk_weights, out_dtype):
        if topk_weights.shape[1] == 1:
            topk_weights = torch.ones_like(topk_weights)
        return super().weighted_combine(rows, index, topk_weights, out_dtype)


class TransposedBlockScales(CpuVendor):
    """An fp8 block-128x128 weight quantizer that writes the tile scales column-major: read as hal's
    row-major `[E, K/128, N/128]`, tile (i, j) gets the scale of tile (j, i) on a square grid."""

    name = "transposed-block-scales"

    def quantize_weight(self, weight, layout, dtype=None):
        q = super().quantize_weight(weight, layout, dtype)
        if q.layout is not ScaleLayout.BLOCK_128X128:
            return q
        experts, k_tiles, n_tiles = q.scale.shape
        scale = q.scale.transpose(1, 2).contiguous().view(experts, k_tiles, n_tiles)
        return QuantizedWeight(q.data, q.layout, scale, q.global_scale)
'''

#: entry-point name -> class in the module above
VENDORS = {
    "drops-last-group": "DropsLastGroup",
    "truncating-fp8": "TruncatingFp8",
    "raw-errors": "RawErrors",
    "inconsistent": "Inconsistent",
    "fused-int8": "FusedInt8",
    "fused-ignores-weights": "FusedIgnoresWeights",
    "sixteen-groups": "SixteenGroups",
    "tail-columns-unwritten": "TailColumnsUnwritten",
    "combine-wraps-256": "CombineWraps256",
    "top1-unweighted": "TopOneUnweighted",
    "transposed-block-scales": "TransposedBlockScales",
}
#: The faults above that only realistic shapes and magnitudes show, one per fault.
SHAPE_FAULTS = (
    "sixteen-groups",
    "tail-columns-unwritten",
    "combine-wraps-256",
    "top1-unweighted",
    "transposed-block-scales",
)


def write_faulty_vendors(root: Path) -> Path:
    """A distribution registering every vendor of `VENDORS` in `hal.vendors`."""
    return write_distribution(
        root,
        "hal-faulty-vendors",
        {"hal.vendors": {name: f"faulty_vendors:{cls}" for name, cls in VENDORS.items()}},
        {"faulty_vendors": SOURCE},
    )
