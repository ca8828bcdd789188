"""An independent float64 MoE reference for the layer tests (no moe or vendor code inside)."""

from __future__ import annotations

import torch

#: Relative error bounds `||y - ref|| / ||ref||` of the layer per (scheme, dispatch dtype), against
#: the float64 MoE of the original float weights. Each bound holds quantization of the weights,
#: of the dispatched rows and of the intermediate activation, plus bf16 outputs; a wrong expert,
#: a swapped gate/up half or a lost token gives errors far above every one of them.
TOLERANCE: dict[tuple[str, str], float] = {
    ("unquantized", "bf16"): 0.02,
    ("unquantized", "fp8"): 0.06,
    ("unquantized", "int8"): 0.03,
    ("w8a8-int8", "int8"): 0.04,
    ("w8a8-int8", "fp8"): 0.07,
    ("w8a8-int8", "bf16"): 0.04,
    ("w8a8-fp8-block", "fp8"): 0.10,
    ("w8a8-fp8-block", "int8"): 0.10,
    ("w8a8-fp8-block", "bf16"): 0.10,
    ("w4a4-int4", "bf16"): 0.35,
    ("nvfp4", "nvfp4"): 0.30,
    ("nvfp4", "bf16"): 0.30,
}


def random_weights(experts: int, hidden: int, intermediate: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 `w13` `[E, H, 2I]` and `w2` `[E, I, H]`, scaled to keep activations of order one."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, hidden, 2 * intermediate, generator=g) / hidden**0.5
    w2 = torch.randn(experts, intermediate, hidden, generator=g) / intermediate**0.5
    return w13, w2


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token float64 softmax top-k, written out token by token."""
    ids, weights = [], []
    for row in logits.to(torch.float64):
        probs = torch.exp(row - row.max())
        probs = probs / probs.sum()
        chosen = sorted(range(row.numel()), key=lambda e: -float(probs[e]))[:top_k]
        w = probs[chosen]
        if renormalize:
            w = w / w.sum()
        ids.append(chosen)
        weights.append(w)
    if not ids:
        return torch.zeros((0, top_k), dtype=torch.int64), torch.zeros((0, top_k), dtype=torch.float64)
    return torch.tensor(ids), torch.stack(weights)


def reference_moe(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """`sum_j w[t, j] * (silu(x W_gate) * (x W_up)) W2` for every token, in float64."""
    intermediate = w2.shape[1]
    out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float64)
    for t in range(x.shape[0]):
        row = x[t].to(torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = row @ w13[e].to(torch.float64)
            gate, up = h[:intermediate], h[intermediate:]
            act = gate / (1 + torch.exp(-gate)) * up
            out[t] += float(weights[t, j]) * (act @ w2[e].to(torch.float64))
    return out


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """`||y - ref|| / ||ref||` in float64 (0 for two empty tensors)."""
    if ref.numel() == 0:
        return 0.0 if y.numel() == 0 else float("inf")
    return float((y.to(torch.float64) - ref).norm() / ref.norm())
