"""Float64 references of the suite, written here and independent of every vendor.

Quantized operands are read through `hal.reference` (the formats' definitions); the
grouped matmul, swiglu and the MoE are computed here in float64, token by token where
that makes the reference obviously right.
"""

from __future__ import annotations

import math
import zlib

import torch

from hal import PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal.reference import activation_value, weight_value


def seed_of(*parts: object) -> int:
    """A seed stable across processes and xdist workers for one test case."""
    return zlib.crc32(repr(parts).encode()) % 100_000


def generator(*parts: object) -> torch.Generator:
    """A CPU generator seeded for one test case."""
    return torch.Generator().manual_seed(seed_of(*parts))


def grouped_matmul(
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor, weight: QuantizedWeight, counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y, |a| @ |b|)` in float64: rows of group g times expert g's weights, group by group."""
    a, b = activation_value(x), weight_value(weight)
    y = torch.zeros((a.shape[0], b.shape[2]), dtype=torch.float64)
    magnitude = torch.zeros_like(y)
    start = 0
    for g, count in enumerate(counts):
        rows = slice(start, start + count)
        y[rows] = a[rows] @ b[g]
        magnitude[rows] = a[rows].abs() @ b[g].abs()
        start += count
    return y, magnitude


def swiglu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(silu(gate) * up, |gate * up|)` in float64, gate the first half of the last dimension."""
    v = x.detach().cpu().double()
    gate, up = v.chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up, (gate * up).abs()


def activation(
    x: torch.Tensor, kind: str, alpha: float = 1.702, limit: float = 7.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(act(x), magnitude)` in float64 for an activation kind (`[gate | up]` halves for gated
    kinds), straight from the formulas; `magnitude` bounds the terms' size for tolerances."""
    v = x.detach().cpu().double()
    gated = kind in ("silu-glu", "gelu-glu", "gelu-tanh-glu", "swiglu-oai")
    gate, up = v.chunk(2, dim=-1) if gated else (v, None)
    if kind == "swiglu-oai":
        gate = torch.minimum(gate, torch.tensor(limit, dtype=torch.float64))
        up = torch.maximum(
            torch.minimum(up, torch.tensor(limit, dtype=torch.float64)),  # type: ignore[arg-type]
            torch.tensor(-limit, dtype=torch.float64),
        )
        out = (up + 1) * gate / (1 + torch.exp(-alpha * gate))
        return out, ((up.abs() + 1) * gate.abs())
    base = kind.removesuffix("-glu")
    if base == "silu":
        act = gate / (1 + torch.exp(-gate))
    elif base == "gelu":
        act = 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2.0)))
    elif base == "gelu-tanh":
        act = 0.5 * gate * (1 + torch.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3)))
    elif base == "relu":
        act = gate.clamp_min(0)
    else:
        raise ValueError(f"unknown activation kind {kind!r}")
    if up is None:
        return act, gate.abs()
    return act * up, (gate * up).abs()


def expert_mlp(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    kind: str = "silu-glu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert's output in float64 for rows `x` `[M, H]`: `act(x w13 + b13) w2 + b2`."""
    h = x.double().cpu() @ w13.double().cpu()
    if b13 is not None:
        h = h + b13.double().cpu()
    out = activation(h, kind)[0] @ w2.double().cpu()
    return out if b2 is None else out + b2.double().cpu()


def moe_features(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    kind: str = "silu-glu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The float64 MoE with an activation kind, biases and shared experts `(w13 [H, Ws], w2 [Is, H], gate [H])`."""
    xd = x.double().cpu()
    out = torch.zeros(xd.shape[0], w2.shape[-1], dtype=torch.float64)
    for e in torch.unique(ids).tolist():
        rows, slots = (ids.cpu() == e).nonzero(as_tuple=True)
        y = expert_mlp(xd[rows], w13[e], w2[e], kind, None if b13 is None else b13[e], None if b2 is None else b2[e])
        out.index_add_(0, rows, weights.cpu().double()[rows, slots, None] * y)
    if shared is not None:
        s13, s2, gate = shared
        y = expert_mlp(xd, s13, s2, kind)
        if gate is not None:
            y = y / (1 + torch.exp(-(xd @ gate.double().cpu())))[:, None]
        out = out + y
    return out


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token in float64: the top-k experts of the softmax and their weights
    (renormalized to sum to one unless `renormalize` is False)."""
    ids, weights = [], []
    for row in logits.double().cpu():
        probs = torch.exp(row - row.max())
        probs = probs / probs.sum()
        chosen = sorted(range(row.numel()), key=lambda e: -float(probs[e]))[:top_k]
        ids.append(chosen)
        weights.append(probs[chosen] / probs[chosen].sum() if renormalize else probs[chosen])
    if not ids:
        return torch.zeros((0, top_k), dtype=torch.int64), torch.zeros((0, top_k), dtype=torch.float64)
    return torch.tensor(ids), torch.stack(weights)


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """`sum_j w[t, j] * (silu(x W_gate) * (x W_up)) W_down` for every token, in float64.

    `w13` is `[E, H, 2I]` (gate columns first), `w2` `[E, I, H]`.
    """
    intermediate = w2.shape[1]
    out = torch.zeros((x.shape[0], w2.shape[2]), dtype=torch.float64)
    for t in range(x.shape[0]):
        row = x[t].double().cpu()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = row @ w13[e].double().cpu()
            gate, up = h[:intermediate], h[intermediate:]
            out[t] += float(weights[t, j]) * ((gate / (1 + torch.exp(-gate)) * up) @ w2[e].double().cpu())
    return out


def moe_by_expert(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """`moe`, computed expert by expert (each expert's rows at once): the same float64 sum, fast enough for
    thousands of tokens and real model sizes."""
    out = torch.zeros((x.shape[0], w2.shape[2]), dtype=torch.float64)
    half = w13.shape[2] // 2
    x, ids, weights = x.double().cpu(), ids.cpu(), weights.double().cpu()
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        h = x[rows] @ w13[e].double().cpu()
        act = torch.nn.functional.silu(h[:, :half]) * h[:, half:]
        out.index_add_(0, rows, weights[rows, slots].unsqueeze(1) * (act @ w2[e].double().cpu()))
    return out


def random_weights(experts: int, hidden: int, intermediate: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 `w13` `[E, H, 2I]` and `w2` `[E, I, H]`, scaled to keep activations of order one."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, hidden, 2 * intermediate, generator=g) / hidden**0.5
    w2 = torch.randn(experts, intermediate, hidden, generator=g) / intermediate**0.5
    return w13, w2


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
    the bf16 roundings of the layer's intermediate results.

    Against this, what is left of an integer layer's error is rounding placement; a lost
    expert or token shows at once, even for int4, whose error against the float MoE is
    large by nature.
    """
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


def weighted_combine(
    rows: torch.Tensor, index: torch.Tensor | None, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sum_j w[t, j] * rows[index[t*k + j]], sum_j |w[t, j] * rows[...]|)` in float64 (`index` None:
    rows in (token, slot) order)."""
    tokens, top_k = weights.shape
    picked = rows.detach().cpu().double()
    if index is not None:
        picked = picked[index.cpu()]
    terms = picked.view(tokens, top_k, rows.shape[-1]) * weights.detach().cpu().double().unsqueeze(-1)
    return terms.sum(dim=1), terms.abs().sum(dim=1)


def expert_order(ids: torch.Tensor, experts: int) -> tuple[list[int], list[int]]:
    """`(order, counts)` of the (token, slot) pairs of `ids` `[T, k]`: sorted by expert, pair order
    kept within an expert; and the pairs of every expert."""
    flat = ids.cpu().reshape(-1).tolist()
    order = sorted(range(len(flat)), key=lambda p: (flat[p], p))
    counts = [0] * experts
    for e in flat:
        counts[e] += 1
    return order, counts


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """`||y - ref|| / ||ref||` in float64 (0 when both are empty)."""
    if ref.numel() == 0:
        return 0.0 if y.numel() == 0 else float("inf")
    ref = ref.detach().cpu().double()  # either may live on the vendor's device
    return float((y.detach().cpu().double() - ref).norm() / ref.norm())


def worst(error: torch.Tensor, bound: torch.Tensor) -> str:
    """Where `error` exceeds `bound` most, in words, for assertion messages."""
    ratio = error / bound.clamp_min(1e-300)
    nan = ratio.isnan()
    index = int(nan.flatten().nonzero()[0]) if bool(nan.any()) else int(ratio.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), error.shape))
    outside = int((~(error <= bound)).sum())  # NaN errors count as outside
    nan_note = f" ({int(nan.sum())} of them NaN)" if bool(nan.any()) else ""
    return (
        f"{outside} of {error.numel()} elements out of bounds{nan_note}; worst at {where}: "
        f"error {float(error.flatten()[index]):.4g} > bound {float(bound.flatten()[index]):.4g}"
    )
