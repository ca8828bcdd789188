"""Per-expert `nn.Linear` MLPs (the common hand-written MoE) turned into one `moe.MoELayer`.

    python examples/linear_experts_to_layer.py

`nn.Linear` stores its weight as `[out_features, in_features]`; the layer takes all experts stacked as
`w13` `[E, H, 2I]` (gate then up) and `w2` `[E, I, H]`, so each weight is transposed once here.
The layer's output is checked against the experts called one by one.
"""

from __future__ import annotations

import torch
from torch import nn

from moe import MoELayer


class ExpertMLP(nn.Module):
    """One SiLU-gated expert, as many engines write it."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def stacked_weights(experts: nn.ModuleList) -> tuple[torch.Tensor, torch.Tensor]:
    """`w13` `[E, H, 2I]` and `w2` `[E, I, H]` from per-expert `nn.Linear` weights (`[out, in]`)."""
    w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]).t() for e in experts])
    w2 = torch.stack([e.down_proj.weight.t() for e in experts])
    return w13.contiguous(), w2.contiguous()


def main() -> int:
    """Convert, run both, print the difference; exit status 1 if it is larger than fp32 rounding."""
    torch.manual_seed(0)
    hidden, intermediate, num_experts, top_k, tokens = 96, 40, 6, 2, 10
    print(f"{num_experts} nn.Linear experts (hidden {hidden}, intermediate {intermediate}), top-{top_k}")
    experts = nn.ModuleList(ExpertMLP(hidden, intermediate) for _ in range(num_experts))
    with torch.no_grad():
        w13, w2 = stacked_weights(experts)
        layer = MoELayer.from_float(w13, w2, top_k=top_k, scheme="fp32")  # unquantized, computed in fp32
        print(f"built the layer on vendor {layer.vendor.name}: w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")

        x = torch.randn(tokens, hidden)
        logits = torch.randn(tokens, num_experts)
        device = layer.vendor.device
        got = layer(x.to(device), logits.to(device)).cpu()

        weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        want = torch.stack([sum(w * experts[int(e)](x[t]) for w, e in zip(weights[t], ids[t])) for t in range(tokens)])
    diff = float((got - want).abs().max())
    print(f"layer vs the experts called one by one: max |diff| = {diff:.2e}")
    return 0 if diff <= 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
