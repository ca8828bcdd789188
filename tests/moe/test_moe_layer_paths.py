"""Which path a layer takes and which runner computes it: one grouped GEMM per projection, the fused op
where declared (and where forced off), a missing GEMM kind refused at construction, the runner registry."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe
from hal import KNOWN_SCHEMES, DispatchDtype, GemmKind, InvalidInput, ScaleLayout, UnsupportedCapability
from hal.reference import ReferenceOps
from tests.moe.test_moe_layer import E, H, I, K, WithoutInt4, _inputs
from tests.support.moe_reference import random_weights, relative_error
from vendors.cpu import CpuVendor


class CountingOps(ReferenceOps):
    """The reference ops, counting grouped matmuls (every GEMM of the reference ends in `grouped_matmul`)."""

    def __init__(self):
        super().__init__()
        self.gemm_calls = 0

    def grouped_matmul(self, x, weight, groups, *, kind, out_dtype):
        self.gemm_calls += 1
        return super().grouped_matmul(x, weight, groups, kind=kind, out_dtype=out_dtype)


class CountingGemms(CpuVendor):
    """The CPU vendor, counting grouped-matmul calls (`ops.gemm_calls`)."""

    name = "cpu-counting"

    def _make_ops(self):
        return CountingOps()


class FusedInt8Ops(ReferenceOps):
    """A fused W8A8-INT8 op computed token by token with its own code, counting its calls."""

    notes = {"fused_deep_moe": "token by token (a test double)"}

    def __init__(self):
        super().__init__()
        self.fused_calls = 0

    def fused_deep_moe(
        self,
        hidden_states,
        topk_ids,
        topk_weights,
        w13,
        w2,
        *,
        scheme,
        process_group,
        dispatch_dtype,
        max_tokens_per_rank,
    ):
        self.fused_calls += 1
        w13f = w13.data.to(torch.float32) * w13.scale.unsqueeze(1)
        w2f = w2.data.to(torch.float32) * w2.scale.unsqueeze(1)
        inter = w2f.shape[1]
        out = torch.zeros(hidden_states.shape, dtype=torch.float32)

        def int8(rows):
            q = self.quantize(rows, dtype=DispatchDtype.INT8, layout=ScaleLayout.PER_TOKEN, global_scale=None)
            return q.data.to(torch.float32) * q.scale.unsqueeze(-1)

        for t in range(hidden_states.shape[0]):
            x = int8(hidden_states[t : t + 1])
            for j in range(topk_ids.shape[1]):
                e = int(topk_ids[t, j])
                h = x @ w13f[e]
                act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
                out[t] += float(topk_weights[t, j]) * (int8(act) @ w2f[e])[0]
        return out.to(hidden_states.dtype)


class FusedInt8(CpuVendor):
    """A CPU vendor declaring a fused W8A8-INT8 op (`FusedInt8Ops`; `ops.fused_calls` counts its calls)."""

    name = "cpu-fused"

    def _detect_capabilities(self):
        return dataclasses.replace(super()._detect_capabilities(), fused_deep_moe=frozenset({"w8a8-int8"}))

    def _make_ops(self):
        return FusedInt8Ops()


def test_one_grouped_gemm_call_per_projection():
    vendor = CountingGemms()
    w13, w2 = random_weights(E, H, I, 51)
    for scheme in ("unquantized", "w8a8-int8", "w4a4-int4"):
        layer = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=vendor)
        for tokens in (1, 40):
            vendor.ops.gemm_calls = 0
            layer(*_inputs(tokens, 52))
            assert vendor.ops.gemm_calls == 2


def test_fused_path_is_used_where_declared_and_equals_the_unfused_path():
    fused_vendor = FusedInt8()
    w13, w2 = random_weights(E, H, I, 61)
    x, logits = _inputs(12, 62, skew=True)
    fused = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=fused_vendor)
    unfused = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=CpuVendor())
    assert fused.fused and not unfused.fused and fused.runner is None
    y_fused, y_unfused = fused(x, logits), unfused(x, logits)
    assert fused_vendor.ops.fused_calls == 1
    assert relative_error(y_fused, y_unfused.to(torch.float64)) < 0.01
    # Other schemes on the same vendor take the unfused path.
    plain = moe.MoELayer.from_float(w13, w2, K, scheme="unquantized", vendor=fused_vendor)
    plain(x, logits)
    assert not plain.fused and fused_vendor.ops.fused_calls == 1


def test_the_fused_option_chooses_the_path():
    w13, w2 = random_weights(E, H, I, 63)
    x, logits = _inputs(9, 64)
    vendor = FusedInt8()
    forced = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=vendor, fused=False)
    assert not forced.fused and forced.runner is not None
    forced(x, logits)
    assert vendor.ops.fused_calls == 0
    required = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=vendor, fused=True)
    required(x, logits)
    assert required.fused and vendor.ops.fused_calls == 1
    with pytest.raises(UnsupportedCapability, match="fused_deep_moe for scheme 'unquantized'"):
        moe.MoELayer(H, I, E, K, vendor=vendor, fused=True)
    with pytest.raises(InvalidInput, match="fused"):
        moe.MoELayer(H, I, E, K, vendor=vendor, fused="yes")


def test_a_missing_gemm_kind_is_refused_at_construction():
    with pytest.raises(UnsupportedCapability, match="int4"):
        moe.MoELayer(H, I, E, K, scheme="w4a4-int4", vendor=WithoutInt4())


def test_runner_registry_lookup_and_errors(cpu):
    registry = moe.RunnerRegistry()
    with pytest.raises(UnsupportedCapability, match=r"format=standard, kernel=int8, scheme=w8a8-int8"):
        moe.MoELayer(H, I, E, K, scheme="w8a8-int8", vendor=cpu, runners=registry)
    calls = []

    def traced(vendor, scheme, weights, dispatched):
        calls.append(dispatched.format)
        return moe.run_grouped_experts(vendor, scheme, weights, dispatched)

    key = moe.RunnerKey(moe.DispatchFormat.STANDARD, GemmKind.INT8, "w8a8-int8")
    registry.register(key, moe.run_grouped_experts)
    with pytest.raises(InvalidInput, match="already registered"):
        registry.register(key, traced)
    registry.register(moe.RunnerKey("standard", "int8", "w8a8-int8", vendor="cpu"), traced)
    w13, w2 = random_weights(E, H, I, 71)
    layer = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=cpu, runners=registry)
    layer(*_inputs(5, 72))
    assert calls == [moe.DispatchFormat.STANDARD]  # the vendor's own entry wins
    other = moe.MoELayer.from_float(w13, w2, K, scheme="w8a8-int8", vendor=CountingGemms(), runners=registry)
    other(*_inputs(5, 72))
    assert calls == [moe.DispatchFormat.STANDARD]  # another vendor gets the generic entry


def test_default_registry_covers_every_format_and_scheme():
    keys = moe.RunnerRegistry.with_defaults(plugins=False).keys()
    covered = {(k.format, k.scheme) for k in keys}
    assert covered == {(f, s) for f in moe.DispatchFormat for s in KNOWN_SCHEMES}
