"""An independent float64 MoE reference for the layer tests (no moe or vendor code inside)."""

from __future__ import annotations

import zlib

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
    ("w4a4-int4", "bf16"): 0.6,  # int4 is that lossy (0.25-0.48 measured); see EMULATED_TOLERANCE
    ("nvfp4", "nvfp4"): 0.30,
    ("nvfp4", "bf16"): 0.30,
}


#: Bounds against `emulated_integer_moe`, which rounds exactly where the integer schemes do;
#: what is left is the rounding of the bf16 output.
EMULATED_TOLERANCE = {"w8a8-int8": 0.006, "w4a4-int4": 0.006}  # 0.0026 worst measured: bf16 outputs


def seed_of(*parts: object) -> int:
    """A seed stable across processes (unlike `hash` of a string) for a test case."""
    return zlib.crc32(repr(parts).encode()) % 100_000


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


def symmetric_roundtrip(x: torch.Tensor, qmax: int, dim: int) -> torch.Tensor:
    """Symmetric integer quantization along `dim` and back: `round(x / s) * s` with
    `s = max|x| / qmax` (round half to even, all-zero slices stay zero).

    The scale and the quotient are fp32, as the documented formula computes them (an fp32
    scale); bf16 inputs hit exact .5 quotients often, and fp64 would round those apart.
    """
    x = x.to(torch.float32)
    step = x.abs().amax(dim=dim, keepdim=True) / qmax
    safe = torch.where(step == 0, torch.ones_like(step), step)
    return torch.round(x / safe).clamp(-qmax, qmax).to(torch.float64) * step.to(torch.float64)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to bf16 and back."""
    return x.to(torch.bfloat16).to(torch.float64)


def emulated_integer_moe(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, qmax: int
) -> torch.Tensor:
    """The float64 MoE of a W{n}A{n} integer scheme: per-channel weights and per-token
    activations (layer input and swiglu output) rounded to `qmax` levels each side, with
    the bf16 roundings of the layer's intermediate results."""
    w13q = symmetric_roundtrip(w13, qmax, dim=1)
    w2q = symmetric_roundtrip(w2, qmax, dim=1)
    intermediate = w2.shape[1]
    xq = symmetric_roundtrip(x.to(torch.float64), qmax, dim=-1)
    out = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            # The layer's GEMMs produce bf16 and its swiglu returns bf16: round where it does,
            # or a rounding step of the activation quantization flips now and then.
            h = bf16(xq[t] @ w13q[e])
            gate, up = h[:intermediate], h[intermediate:]
            act = symmetric_roundtrip(bf16(gate / (1 + torch.exp(-gate)) * up), qmax, dim=-1)
            out[t] += float(weights[t, j]) * (act @ w2q[e])
    return out
