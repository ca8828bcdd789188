"""Expert weights in the `nn.Linear` layout (`[E, 2I, H]`, `[E, H, I]`) are refused with a message that says to
transpose them; transposed, the same weights build the layer."""

from __future__ import annotations

import pytest
import torch

from hal import InvalidInput
from moe import MoELayer


@pytest.mark.parametrize(
    ("hidden", "intermediate", "activation"), [(96, 40, "silu-glu"), (80, 40, "silu-glu"), (50, 50, "gelu-glu")]
)
def test_linear_layout_is_refused_with_the_transpose_named(hidden, intermediate, activation):
    gated = activation.endswith("glu")
    w13 = torch.randn(5, (2 if gated else 1) * intermediate, hidden)  # [E, out, in]
    w2 = torch.randn(5, hidden, intermediate)
    with pytest.raises(InvalidInput, match=r"nn\.Linear layout.*w13\.transpose\(1, 2\) and w2\.transpose\(1, 2\)"):
        MoELayer.from_float(w13, w2, 2, activation=activation)
    layer = MoELayer.from_float(w13.transpose(1, 2), w2.transpose(1, 2), 2, activation=activation)
    assert (layer.hidden_size, layer.intermediate_size) == (hidden, intermediate)


def test_other_mismatches_do_not_mention_the_linear_layout():
    with pytest.raises(InvalidInput) as refused:
        MoELayer.from_float(torch.randn(5, 96, 80), torch.randn(5, 41, 96), 2)
    assert "nn.Linear" not in str(refused.value)


def test_plain_activation_linear_layout_reads_as_swapped_sizes_and_its_forward_is_refused():
    """Not gated, `[E, I, H]` and `[E, H, I]` is also a valid pair (H and I swapped): the layer is built with
    the wrong hidden size, and the model's hidden states are refused at the first call."""
    layer = MoELayer.from_float(torch.randn(5, 40, 72), torch.randn(5, 72, 40), 2, activation="gelu")
    assert layer.hidden_size == 40
    with pytest.raises(InvalidInput):
        layer(torch.randn(3, 72, dtype=torch.bfloat16, device=layer.vendor.device), torch.randn(3, 5))
