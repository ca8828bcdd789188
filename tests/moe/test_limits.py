"""Limits refused up front, naming the limit, on every vendor (here the CPU and the emulated Ascend
vendor): float settings outside the fp32 range (routing and activations compute in fp32), low-latency
capacities whose buffers ask for more memory than any device has where the vendor does not state its
memory; and router logits in float64, a documented dtype, routed as documented (read in fp32)."""

from __future__ import annotations

import re

import pytest
import torch

import hal
import moe
from hal import FP32_MAX, FP32_TINY, MAX_DEVICE_MEMORY_BYTES, Activation, DispatchConfig, InvalidInput, Vendor
from moe.explain import explain_layer
from moe.schemes.nvfp4 import NvFp4, nvfp4_global_scale
from moe.schemes.w8a8_fp8 import W8A8Fp8
from vendors.cpu import CpuVendor

VENDORS = ["cpu", "ascend-emulated"]
E, H, I, K = 8, 64, 32, 2
OUT_OF_RANGE = [1e39, 1e300, 1e-39, 1e-300, float("inf")]


@pytest.fixture(params=VENDORS)
def vendor(request) -> Vendor:
    return hal.get_vendor(request.param)


def _refused(call, argument: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        call()
    message = str(raised.value)
    assert message.startswith(f"{argument}:") and "fp32 range" in message, message


ROUTERS = {
    "softmax": lambda f: moe.SoftmaxTopK(E, K, routed_scaling_factor=f),
    "sigmoid": lambda f: moe.SigmoidTopK(E, K, routed_scaling_factor=f),
    "grouped": lambda f: moe.GroupedTopK(E, K, num_groups=2, topk_groups=1, routed_scaling_factor=f),
}


@pytest.mark.parametrize("factor", OUT_OF_RANGE)
@pytest.mark.parametrize("router", ROUTERS)
def test_a_routed_scaling_factor_outside_fp32_is_refused(router, factor):
    _refused(lambda: ROUTERS[router](factor), "routed_scaling_factor")


@pytest.mark.parametrize("router", ROUTERS)
def test_the_fp32_extremes_are_accepted_and_scale_exactly(vendor, router):
    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(0))
    one = ROUTERS[router](1.0)(logits, vendor)
    for factor in (FP32_TINY, 2.0**100, FP32_MAX):
        scaled = ROUTERS[router](factor)(logits, vendor)
        assert torch.equal(scaled.topk_ids, one.topk_ids)
        assert torch.equal(scaled.topk_weights, one.topk_weights * factor)


@pytest.mark.parametrize("value", OUT_OF_RANGE)
def test_float_settings_of_activations_and_schemes_outside_fp32_are_refused(value):
    _refused(lambda: Activation("swiglu-oai", alpha=value), "activation alpha")
    _refused(lambda: Activation("swiglu-oai", limit=value), "activation limit")
    _refused(lambda: NvFp4(value, 1.0), "input_global_scale")
    _refused(lambda: NvFp4(1.0, value), "intermediate_global_scale")
    _refused(lambda: W8A8Fp8(input_scale=value), "input_scale")
    _refused(lambda: W8A8Fp8(intermediate_scale=value), "intermediate_scale")
    _refused(lambda: nvfp4_global_scale(value), "amax")


def test_a_calibration_maximum_whose_global_scale_overflows_fp32_is_refused():
    assert nvfp4_global_scale(1.0) == 448 * 6
    _refused(lambda: nvfp4_global_scale(1e-36), "global scale 448 * 6 / amax")


# -- router logits in float64 ------------------------------------------------------------------------


def _layer(vendor: Vendor, **kwargs) -> moe.MoELayer:
    gen = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(E, H, 2 * I, generator=gen) / 8, torch.randn(E, I, H, generator=gen) / 8
    return moe.MoELayer.from_float(w13, w2, K, vendor=vendor, environ={}, **kwargs)


def test_float64_router_logits_route_as_their_fp32_values(vendor):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, H, generator=gen).to(torch.bfloat16)
    logits = torch.randn(7, E, generator=gen, dtype=torch.float64)
    layer = _layer(vendor)
    assert torch.equal(layer(x, logits), layer(x, logits.to(torch.float32)))
    weights, ids = vendor.softmax_topk(logits, K)
    want_weights, want_ids = vendor.softmax_topk(logits.to(torch.float32), K)
    assert weights.dtype == torch.float32 and torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


def test_float64_router_logits_beyond_fp32_are_refused_where_routing_is_checked(vendor):
    layer = _layer(vendor, check_routing=True)
    logits = torch.zeros(3, E, dtype=torch.float64)
    logits[1, 2] = 1e39  # finite in float64, inf in the fp32 the router computes in
    with pytest.raises(InvalidInput, match=re.escape("router_logits: expected finite values (at most 3.40282e+38")):
        layer(torch.ones(3, H, dtype=torch.bfloat16), logits)


# -- memory ----------------------------------------------------------------------------------------------


class UnknownMemory(CpuVendor):
    """A CPU vendor that does not state its device memory."""

    name = "cpu-unknown-memory"
    device_memory_bytes = Vendor.device_memory_bytes


@pytest.mark.parametrize("which", ["ascend-emulated", "unknown"])
def test_a_low_latency_capacity_beyond_any_device_is_refused_where_memory_is_unknown(which):
    vendor = hal.get_vendor(which) if which != "unknown" else UnknownMemory()
    assert vendor.device_memory_bytes() is None
    for mode in ("low-latency", "auto"):
        config = DispatchConfig(max_dispatch_tokens_per_rank=10**13, ep_mode=mode)
        with pytest.raises(InvalidInput) as raised:
            moe.MoELayer(H, I, E, K, vendor=vendor, environ={}, dispatch=config)
        message = str(raised.value)
        assert message.startswith("max_dispatch_tokens_per_rank:") and "hal.MAX_DEVICE_MEMORY_BYTES" in message
    fits = moe.MoELayer(
        H, I, E, K, vendor=vendor, environ={}, dispatch=DispatchConfig(max_dispatch_tokens_per_rank=1024)
    )
    assert fits.dispatcher.memory_bytes <= MAX_DEVICE_MEMORY_BYTES


@pytest.mark.parametrize("which", ["cpu", "ascend-emulated", "unknown"])
@pytest.mark.parametrize("mode", ["low-latency", "auto"])
def test_the_explanation_refuses_the_capacity_the_layer_refuses_with_the_same_reason(which, mode):
    vendor = hal.get_vendor(which) if which != "unknown" else UnknownMemory()
    spec = hal.LayerSpec(H, I, E, K)
    for capacity in (10**13, 1024):
        config = DispatchConfig(max_dispatch_tokens_per_rank=capacity, ep_mode=mode)
        explained = explain_layer(vendor, spec, dispatch=config)
        try:
            moe.MoELayer(H, I, E, K, vendor=vendor, environ={}, dispatch=config)
            refused = None
        except InvalidInput as exc:
            refused = str(exc)
        assert list(explained.problems) == ([] if refused is None else [refused])
        assert (refused is None) == (capacity == 1024)
