"""The MoE layer on the CUDA vendor (skipped cleanly without a GPU): same code, GPU tensors."""

from __future__ import annotations

import warnings

import pytest
import torch

import moe
from hal import DispatchConfig, DispatchDtype, UnsupportedCapability
from tests.support.moe_reference import TOLERANCE, random_weights, reference_moe, relative_error, seed_of, softmax_topk
from vendors.cuda import CudaVendor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, H, I, K = 8, 384, 128, 2


@pytest.mark.parametrize("capacity", [None, 32])
@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-int8", "w8a8-fp8-block"])
def test_layer_on_the_gpu_matches_float64(scheme, capacity):
    vendor = CudaVendor()
    w13, w2 = random_weights(E, H, I, seed_of("cuda", scheme))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # int8 -> fp8 fallback warning, checked elsewhere
        layer = moe.MoELayer.from_float(
            w13, w2, K, scheme=scheme, vendor=vendor, dispatch=DispatchConfig(max_dispatch_tokens_per_rank=capacity)
        )
    if scheme == "w8a8-int8" and vendor.capabilities().supports_fp8_dispatch:
        assert layer.plan.resolved is DispatchDtype.FP8  # the declared int8 -> fp8 fallback
    g = torch.Generator().manual_seed(seed_of("cuda-inputs", scheme))
    x = torch.randn(24, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(24, E, generator=g)
    y = layer(x.cuda(), logits.cuda())
    assert y.is_cuda and y.dtype == torch.bfloat16
    ids, weights = softmax_topk(logits, K)
    ref = reference_moe(x, ids, weights, w13, w2)
    assert relative_error(y.cpu(), ref) < TOLERANCE[(scheme, layer.plan.resolved.value)]


def test_w4a4_is_refused_where_cuda_declares_no_int4_gemm():
    vendor = CudaVendor()
    if vendor.capabilities().supports_gemm("int4"):
        pytest.skip("this CUDA table declares int4")
    with pytest.raises(UnsupportedCapability, match="int4"):
        moe.MoELayer(H, I, E, K, scheme="w4a4-int4", vendor=vendor)
