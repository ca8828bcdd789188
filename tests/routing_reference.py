"""Independent float64 routing references for the router tests (plain Python per token; they never call the code under test)."""

from __future__ import annotations

import math

import pytest
import torch

from moe.routing import Routing


# -- independent float64 references (plain Python per token; never call the code under test) -------


def _rows(logits: torch.Tensor) -> list[list[float]]:
    """The logits as float64 Python lists, exactly as the router sees them (after dtype rounding)."""
    return logits.to(torch.float64).tolist()


def _top(values: list[float], k: int, eligible: list[int] | None = None) -> list[int]:
    """Indices of the k largest values (among `eligible`), largest first."""
    pool = range(len(values)) if eligible is None else eligible
    return sorted(pool, key=lambda i: values[i], reverse=True)[:k]


def ref_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> list[dict[int, float]]:
    """Per token: {expert id: weight}."""
    out = []
    for row in _rows(logits):
        m = max(row)
        exps = [math.exp(x - m) for x in row]
        total = sum(exps)
        probs = [e / total for e in exps]
        ids = _top(probs, k)
        weights = [probs[i] for i in ids]
        if renormalize:
            s = sum(weights)
            weights = [w / s for w in weights]
        out.append(dict(zip(ids, weights)))
    return out


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def ref_grouped_detail(logits, k, num_groups, topk_groups, bias=None, renormalize=True, scale=1.0):
    """Per token: ({expert id: weight}, set of kept group indices)."""
    out = []
    bias_list = [0.0] * logits.shape[1] if bias is None else bias.to(torch.float64).tolist()
    for row in _rows(logits):
        n = len(row)
        per_group = n // num_groups
        scores = [_sigmoid(x) for x in row]
        choice = [s + b for s, b in zip(scores, bias_list)]
        if num_groups > 1:
            group_scores = []
            for g in range(num_groups):
                members = sorted((choice[i] for i in range(g * per_group, (g + 1) * per_group)), reverse=True)
                group_scores.append(members[0] + members[1])
            kept = set(_top(group_scores, topk_groups))
        else:
            kept = {0}
        eligible = [i for i in range(n) if i // per_group in kept]
        ids = _top(choice, k, eligible)
        weights = [scores[i] for i in ids]
        if renormalize:
            s = sum(weights)
            weights = [w / s for w in weights]
        out.append(({i: w * scale for i, w in zip(ids, weights)}, kept))
    return out


def ref_grouped(logits, k, num_groups, topk_groups, bias=None, renormalize=True, scale=1.0):
    return [d for d, _ in ref_grouped_detail(logits, k, num_groups, topk_groups, bias, renormalize, scale)]


def as_dicts(r: Routing) -> list[dict[int, float]]:
    """The routing as per-token {expert id: weight}; asserts ids are unique per token."""
    out = []
    for ids, ws in zip(r.topk_ids.tolist(), r.topk_weights.tolist()):
        assert len(set(ids)) == len(ids), f"duplicate expert in {ids}"
        out.append(dict(zip(ids, ws)))
    return out


def assert_matches(r: Routing, expected: list[dict[int, float]], k: int, *, tol: float = 2e-6) -> None:
    """Shape/dtype contract, then per-token equal id sets and weights matched per id."""
    assert r.topk_ids.dtype == torch.int64
    assert r.topk_weights.dtype == torch.float32
    assert tuple(r.topk_ids.shape) == tuple(r.topk_weights.shape) == (len(expected), k)
    assert (r.num_tokens, r.top_k) == (len(expected), k)
    got = as_dicts(r)
    for t, (g, e) in enumerate(zip(got, expected)):
        assert set(g) == set(e), f"token {t}: ids {sorted(g)} != reference {sorted(e)}"
        for i in e:
            assert g[i] == pytest.approx(e[i], rel=tol, abs=tol), f"token {t}, expert {i}"


def distinct_logits(tokens: int, experts: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random logits whose values in every row are well separated (>= 0.25 apart), so no ties in
    any dtype: a shuffled ladder of multiples of 0.25 (exact in bf16/fp16) around zero."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=g).to(torch.float32) * 0.25 - experts * 0.125 for _ in range(tokens)]
    x = torch.stack(rows) if rows else torch.empty(0, experts)
    return x.to(dtype)


def randn_logits(tokens: int, experts: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g) * scale


def logit(p: float) -> float:
    """The logit whose sigmoid is p."""
    return math.log(p / (1.0 - p))
