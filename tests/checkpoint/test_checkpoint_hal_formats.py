"""hal's nvfp4 weights take a global scale per output channel (`[E, N]`) besides one per expert (`[E]`):
checkpoints whose gate and up projections have different `weight_scale_2` stay exact. Every reference
consumer honours it."""

from __future__ import annotations

import pytest
import torch

from hal import GemmKind, Groups, InvalidInput, QuantizedWeight, ScaleLayout, get_vendor
from hal.reference import activation_value, dequantize_weight, grouped_matmul, quantize, weight_value
from tests.support.checkpoint_synthetic import SIGNED_E2M1

E, K, N = 3, 32, 10


def nvfp4_weight(global_scale: torch.Tensor) -> tuple[QuantizedWeight, torch.Tensor]:
    """Random codes and block scales, and the float64 value computed here, nibble by nibble."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (E, K, N), generator=g)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # along K, the even k low
    scale = (torch.rand(E, K // 16, N, generator=g) * 4 + 0.25).to(torch.float8_e4m3fn)
    gs = global_scale.double()
    per = gs[:, None, :] if gs.dim() == 2 else gs[:, None, None]
    value = SIGNED_E2M1[codes] * scale.double().repeat_interleave(16, 1) / per
    return QuantizedWeight(packed, ScaleLayout.BLOCK_16, scale, global_scale), value


@pytest.mark.parametrize("shape", [(E,), (E, N)])
def test_weight_value_and_dequantize_honour_both_global_scales(shape):
    gs = torch.rand(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float32) * 100 + 1
    w, value = nvfp4_weight(gs)
    assert torch.equal(weight_value(w), value)
    torch.testing.assert_close(dequantize_weight(w).double(), value, rtol=2.0**-22, atol=0)
    part = w.select(slice(1, 3))
    assert tuple(part.global_scale.shape) == (2, *shape[1:])
    assert torch.equal(weight_value(part), value[1:3])


def test_the_reference_grouped_matmul_uses_per_channel_global_scales():
    gs = torch.linspace(1, 40, E * N, dtype=torch.float32).reshape(E, N)
    w, value = nvfp4_weight(gs)
    x = quantize(torch.randn(7, K, generator=torch.Generator().manual_seed(2)), "nvfp4")
    groups = Groups.from_counts(torch.tensor([3, 0, 4]))
    y = grouped_matmul(x, w, groups, out_dtype=torch.float32)
    rows = activation_value(x)
    expected = torch.cat([rows[:3] @ value[0], rows[3:] @ value[2]])
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    assert get_vendor("cpu").capabilities().supports_gemm(GemmKind.NVFP4)


@pytest.mark.parametrize(
    "bad", [torch.ones(E, N + 1), torch.ones(N), torch.ones(E, N, dtype=torch.float16), torch.ones(E, 1, N)]
)
def test_other_global_scale_shapes_are_refused(bad):
    w, _ = nvfp4_weight(torch.ones(E))
    with pytest.raises(
        InvalidInput, match=r"QuantizedWeight.global_scale: expected float32 of shape \(3,\) or \(3, 10\)"
    ):
        QuantizedWeight(w.data, ScaleLayout.BLOCK_16, w.scale, bad)
