"""What the layer is compared with: the same vendor kernels called directly, and a plain
per-expert loop in PyTorch.

`direct_forward` makes the layer's kernel calls in a straight line (the vendor's softmax-top-k, the
vendor's sort by expert with each sorted row's token, quantize, the grouped GEMM with the SiLU-GLU
activation reading the tokens through that index, quantize, grouped GEMM, the vendor's weighted
combine) with none of moe's objects in between: no `MoELayer`, plan, dispatcher, scheme or runner
lookup. The time it saves is the abstraction's overhead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hal import Groups, Vendor
from moe import MoELayer


def direct_forward(vendor: Vendor, layer: MoELayer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The layer's output for `x` `[T, H]`, computed by calling the vendor's ops directly."""
    weights = layer.expert_weights
    top_k, experts = layer.top_k, layer.num_experts
    topk_weights, ids = vendor.softmax_topk(logits, top_k)
    _, inverse, counts, token = vendor.sort_by_expert(ids, experts, tokens=True)
    groups = Groups.from_counts(counts)
    plan = layer.plan
    q = vendor.quantize(x, plan.resolved, layout=plan.scale_layout)
    gemm = layer.scheme.gemm_kind().spec  # the dispatched rows are its operand as they are (bf16, fp8 block)
    act = vendor.grouped_matmul(
        q.data if gemm.is_float else q,
        weights.w13,
        groups,
        out_dtype=torch.bfloat16,
        activation=weights.activation,
        row_index=token,
    )
    second = act if gemm.is_float else vendor.quantize(act, gemm.activation.dtype, layout=gemm.activation.layout)
    y = vendor.grouped_matmul(second, weights.w2, groups, out_dtype=torch.bfloat16)
    return vendor.weighted_combine(y, inverse, topk_weights, x.dtype)


def per_expert_loop(
    x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int
) -> torch.Tensor:
    """A straightforward PyTorch MoE in bf16: for each expert, gather its tokens and run two matmuls."""
    topk_weights, ids = _softmax_topk(logits, top_k)
    out = torch.zeros(x.shape[0], w2.shape[-1], dtype=torch.float32, device=x.device)
    intermediate = w2.shape[1]
    for e in range(w13.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token] @ w13[e]
        y = (F.silu(h[:, :intermediate]) * h[:, intermediate:]) @ w2[e]
        out.index_add_(0, token, y.to(torch.float32) * topk_weights[token, slot].unsqueeze(1))
    return out.to(x.dtype)


def _softmax_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Renormalised softmax top-k weights and ids, as the layer's default router computes them."""
    weights, ids = torch.topk(torch.softmax(logits.to(torch.float32), dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids
