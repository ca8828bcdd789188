"""Vendors with one deliberate fault each, installed as a real distribution for the suite to catch.

Each subclasses the CPU reference vendor and breaks exactly one thing, in the ops its `_make_ops`
returns (a `hal.reference.ReferenceOps` subclass: hal's checks still run before the fault);
`RawErrors` (in a module of its own) redefines a `Vendor` op method to skip those checks, which
hal refuses when the class is defined, so its plugin fails to load with the reason. The tests run
`hal conformance` against them in a fresh interpreter and check which tests fail.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.plugin_dist import write_distribution

SOURCE = '''
import dataclasses

import torch
import torch.nn.functional as F

from hal import DispatchDtype, QuantizedTensor, QuantizedWeight, ScaleLayout
from hal.reference import ReferenceOps
from vendors.cpu import CpuVendor


class DropsLastGroupOps(ReferenceOps):
    """The reference ops, but the grouped matmul leaves the rows of the last group at zero (the activated
    and gathered products go through it), and a per-expert bias is refused with a TypeError."""

    def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
        y = super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)
        last = int(groups.counts()[-1])
        if last:
            y[y.shape[0] - last:] = 0
        return y

    def add_expert_bias(self, y, bias, *, groups):
        raise TypeError("drops-last-group: this grouped matmul takes no bias")


class DropsLastGroup(CpuVendor):
    """Grouped matmul that leaves the rows of the last group at zero (and takes no per-expert bias)."""

    name = "drops-last-group"

    def _make_ops(self):
        return DropsLastGroupOps()


class TruncatingFp8Ops(ReferenceOps):
    """The reference ops, but fp8 quantization truncates toward zero instead of rounding to nearest."""

    def quantize(self, x, *, dtype, layout, global_scale):
        q = super().quantize(x, dtype=dtype, layout=layout, global_scale=global_scale)
        if q.dtype is not DispatchDtype.FP8:
            return q
        xf = x.to(torch.float32)
        scale = q.scale.unsqueeze(-1) if q.scale.dim() == xf.dim() - 1 else \\
            q.scale.repeat_interleave(128, dim=-1)[..., : xf.shape[-1]]
        v = xf / torch.where(scale == 0, torch.ones_like(scale), scale)
        truncated = (v.view(torch.int32) & ~0xFFFFF).view(torch.float32)  # keep 3 mantissa bits
        return QuantizedTensor(truncated.to(torch.float8_e4m3fn), q.dtype, q.layout, q.scale)


class TruncatingFp8(CpuVendor):
    """fp8 quantization that truncates toward zero instead of rounding to nearest."""

    name = "truncating-fp8"

    def _make_ops(self):
        return TruncatingFp8Ops()


class Inconsistent(CpuVendor):
    """Declares an int8 -> nvfp4 fallback while carrying neither."""

    name = "inconsistent"

    def _detect_capabilities(self):
        return dataclasses.replace(
            super()._detect_capabilities(),
            dispatch_dtypes=frozenset({DispatchDtype.BF16, DispatchDtype.FP8}),
            fallbacks={DispatchDtype.INT8: DispatchDtype.NVFP4, DispatchDtype.NVFP4: None})


class FusedInt8Ops(ReferenceOps):
    """The reference ops with a fused_deep_moe for W8A8-INT8, computed right, token by token (activations
    quantized to int8 per token before each GEMM, as the unfused path does)."""

    uniform_weights = False

    def fused_deep_moe(self, hidden_states, topk_ids, topk_weights, w13, w2, *, scheme, process_group,
                       dispatch_dtype, max_tokens_per_rank):
        w13f = w13.data.to(torch.float32) * w13.scale.unsqueeze(1)
        w2f = w2.data.to(torch.float32) * w2.scale.unsqueeze(1)
        inter = w2f.shape[1]
        k = topk_ids.shape[1]
        out = torch.zeros(hidden_states.shape, dtype=torch.float32)
        for t in range(hidden_states.shape[0]):
            x = self._int8_round_trip(hidden_states[t:t + 1])
            for j in range(k):
                e = int(topk_ids[t, j])
                h = x @ w13f[e]
                act = self._int8_round_trip(F.silu(h[:, :inter]) * h[:, inter:])
                weight = 1.0 / k if self.uniform_weights else float(topk_weights[t, j])
                out[t] += weight * (act @ w2f[e])[0]
        return out.to(hidden_states.dtype)

    def _int8_round_trip(self, x):
        """`x` quantized to int8 per token and back in fp32."""
        q = self.quantize(x, dtype=DispatchDtype.INT8, layout=ScaleLayout.PER_TOKEN, global_scale=None)
        return self.dequantize(q, out_dtype=torch.float32)


class FusedInt8(CpuVendor):
    """Declares fused_deep_moe for W8A8-INT8 and computes it right, token by token."""

    name = "fused-int8"

    def _detect_capabilities(self):
        return dataclasses.replace(super()._detect_capabilities(), fused_deep_moe=frozenset({"w8a8-int8"}))

    def _make_ops(self):
        return FusedInt8Ops()


class FusedIgnoresWeightsOps(FusedInt8Ops):
    """The fused op of `FusedInt8Ops`, averaging the top-k experts instead of applying the routing weights."""

    uniform_weights = True


class FusedIgnoresWeights(FusedInt8):
    """A fused op that averages the top-k experts instead of applying the routing weights."""

    name = "fused-ignores-weights"

    def _make_ops(self):
        return FusedIgnoresWeightsOps()


# -- faults only realistic shapes show (tests/conformance/test_conformance_catches_shape_faults.py) ----------------


def _experts(weight, index):
    """The weight with its experts taken in the order of `index`."""
    def pick(t):
        return None if t is None or t.dim() == 0 else t[index.to(t.device)]
    return QuantizedWeight(weight.data[index.to(weight.data.device)], weight.layout, pick(weight.scale),
                           pick(weight.global_scale))


class SixteenGroupsOps(ReferenceOps):
    """The reference ops, but the grouped matmul's expert table holds 16 entries: group g >= 16 uses expert
    g % 16's weights (the activated and gathered products go through it; a bias keeps its own group)."""

    def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
        count = groups.num_groups
        if count > 16 and weight.num_experts == count:
            weight = _experts(weight, torch.arange(count) % 16)
        return super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)


class SixteenGroups(CpuVendor):
    """A grouped matmul whose expert table holds 16 entries: group g >= 16 uses expert g % 16's weights."""

    name = "sixteen-groups"

    def _make_ops(self):
        return SixteenGroupsOps()


class TailColumnsUnwrittenOps(ReferenceOps):
    """The reference ops, but the weight quantizer leaves the columns of a partial last 128-column tile zero
    (scaled layouts only)."""

    def quantize_weight(self, weight, *, layout, dtype):
        q = super().quantize_weight(weight, layout=layout, dtype=dtype)
        n = weight.shape[2]
        if q.layout is ScaleLayout.NONE or n % 128 == 0:
            return q
        first = (n - n % 128) // (8 if q.is_int4 else 1)  # int4: eight columns per int32 word
        data = q.data.clone()
        (data.view(torch.uint8) if data.element_size() == 1 else data)[..., first:] = 0
        return QuantizedWeight(data, q.layout, q.scale, q.global_scale)


class TailColumnsUnwritten(CpuVendor):
    """A weight quantizer working in 128-column tiles that never writes a partial last tile: when N is
    not a multiple of 128, the last N % 128 columns come out zero (scaled layouts only)."""

    name = "tail-columns-unwritten"

    def _make_ops(self):
        return TailColumnsUnwrittenOps()


class CombineWraps256Ops(ReferenceOps):
    """The reference ops, but the combine reads the routing weights through a 256-token window."""

    def weighted_combine(self, rows, index, topk_weights, *, out_dtype):
        tokens = topk_weights.shape[0]
        if tokens > 256:
            topk_weights = topk_weights[torch.arange(tokens, device=topk_weights.device) % 256]
        return super().weighted_combine(rows, index, topk_weights, out_dtype=out_dtype)


class CombineWraps256(CpuVendor):
    """A combine whose weights are read through a 256-token window: token t >= 256 gets the routing
    weights of token t % 256."""

    name = "combine-wraps-256"

    def _make_ops(self):
        return CombineWraps256Ops()


class TopOneUnweightedOps(ReferenceOps):
    """The reference ops, but the combine ignores the routing weights at top-1."""

    def weighted_combine(self, rows, index, topk_weights, *, out_dtype):
        if topk_weights.shape[1] == 1:
            topk_weights = torch.ones_like(topk_weights)
        return super().weighted_combine(rows, index, topk_weights, out_dtype=out_dtype)


class TopOneUnweighted(CpuVendor):
    """A combine whose top-1 fast path copies each token's row without applying its routing weight."""

    name = "top1-unweighted"

    def _make_ops(self):
        return TopOneUnweightedOps()


class TransposedBlockScalesOps(ReferenceOps):
    """The reference ops, but the fp8 block-128x128 weight quantizer writes the tile scales column-major."""

    def quantize_weight(self, weight, *, layout, dtype):
        q = super().quantize_weight(weight, layout=layout, dtype=dtype)
        if q.layout is not ScaleLayout.BLOCK_128X128:
            return q
        experts, k_tiles, n_tiles = q.scale.shape
        scale = q.scale.transpose(1, 2).contiguous().view(experts, k_tiles, n_tiles)
        return QuantizedWeight(q.data, q.layout, scale, q.global_scale)


class TransposedBlockScales(CpuVendor):
    """An fp8 block-128x128 weight quantizer that writes the tile scales column-major: read as hal's
    row-major `[E, K/128, N/128]`, tile (i, j) gets the scale of tile (j, i) on a square grid."""

    name = "transposed-block-scales"

    def _make_ops(self):
        return TransposedBlockScalesOps()
'''

#: entry-point name -> class in the module above
VENDORS = {
    "drops-last-group": "DropsLastGroup",
    "truncating-fp8": "TruncatingFp8",
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


#: A vendor class redefining `Vendor.swiglu` (skipping hal's checks): refused when its module is imported.
RAW_SOURCE = '''
import torch.nn.functional as F

from vendors.cpu import CpuVendor


class RawErrors(CpuVendor):
    """swiglu without input validation: bad input surfaces as torch's own errors."""

    name = "raw-errors"

    def swiglu(self, x):
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]
'''


def write_faulty_vendors(root: Path) -> Path:
    """A distribution registering every vendor of `VENDORS` in `hal.vendors`, and `raw-errors`."""
    return write_distribution(
        root,
        "hal-faulty-vendors",
        {
            "hal.vendors": {
                **{name: f"faulty_vendors:{cls}" for name, cls in VENDORS.items()},
                "raw-errors": "faulty_raw:RawErrors",
            }
        },
        {"faulty_vendors": SOURCE, "faulty_raw": RAW_SOURCE},
    )
