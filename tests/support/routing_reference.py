"""Independent float64 routing references for the router tests.

Plain Python per token; they never call the code under test. The `*_detail` forms also return each
token's decision margin (how far its choices are from a tie), so realistic-shape tests can leave out
the rare near-tied tokens whose fp32 choice could go either way.
"""

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


def _margin(values: list[float], chosen: list[int], pool: list[int]) -> float:
    """How far the last chosen value is above the best value left out of `pool` (inf if none is left out)."""
    left = [values[i] for i in pool if i not in set(chosen)]
    return min(values[i] for i in chosen) - max(left) if left else math.inf


def _finish(scores: list[float], ids: list[int], renormalize: bool, scale: float) -> dict[int, float]:
    """{id: weight}: the chosen experts' scores, optionally renormalized, times `scale`."""
    weights = [scores[i] for i in ids]
    if renormalize:
        total = sum(weights)
        weights = [w / total for w in weights]
    return {i: w * scale for i, w in zip(ids, weights)}


def _softmax(row: list[float]) -> list[float]:
    m = max(row)
    exps = [math.exp(x - m) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def ref_softmax_topk_detail(logits: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0):
    """Per token: ({expert id: weight}, decision margin)."""
    out = []
    for row in _rows(logits):
        probs = _softmax(row)
        ids = _top(probs, k)
        out.append((_finish(probs, ids, renormalize, scale), _margin(probs, ids, list(range(len(row))))))
    return out


def ref_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0) -> list[dict[int, float]]:
    """Per token: {expert id: weight}."""
    return [d for d, _ in ref_softmax_topk_detail(logits, k, renormalize, scale)]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _bias_list(bias: torch.Tensor | None, n: int) -> list[float]:
    return [0.0] * n if bias is None else bias.to(torch.float32).to(torch.float64).tolist()


def ref_sigmoid_topk_detail(logits: torch.Tensor, k: int, bias=None, renormalize=False, scale=1.0):
    """Per token: ({expert id: weight}, decision margin). Without a bias the k largest logits are
    chosen (Llama-4), with one the k largest sigmoid(logit) + bias; weights are the sigmoids."""
    out = []
    for row in _rows(logits):
        scores = [_sigmoid(x) for x in row]
        choice = row if bias is None else [s + b for s, b in zip(scores, _bias_list(bias, len(row)))]
        ids = _top(choice, k)
        out.append((_finish(scores, ids, renormalize, scale), _margin(choice, ids, list(range(len(row))))))
    return out


def ref_sigmoid_topk(logits, k, bias=None, renormalize=False, scale=1.0) -> list[dict[int, float]]:
    """Per token: {expert id: weight}."""
    return [d for d, _ in ref_sigmoid_topk_detail(logits, k, bias, renormalize, scale)]


def ref_grouped_topk_detail(
    logits, k, num_groups, topk_groups, *, scoring="softmax", group_score="max", bias=None, renormalize=True, scale=1.0
):
    """Per token: ({expert id: weight}, set of kept group indices, decision margin)."""
    out = []
    for row in _rows(logits):
        n = len(row)
        per_group = n // num_groups
        scores = _softmax(row) if scoring == "softmax" else [_sigmoid(x) for x in row]
        choice = [s + b for s, b in zip(scores, _bias_list(bias, n))]
        group_scores = []
        for g in range(num_groups):
            members = sorted((choice[i] for i in range(g * per_group, (g + 1) * per_group)), reverse=True)
            group_scores.append(members[0] if group_score == "max" else members[0] + members[1])
        kept = _top(group_scores, topk_groups)
        eligible = [i for i in range(n) if i // per_group in set(kept)]
        ids = _top(choice, k, eligible)
        margin = min(_margin(choice, ids, eligible), _margin(group_scores, kept, list(range(num_groups))))
        out.append((_finish(scores, ids, renormalize, scale), set(kept), margin))
    return out


def ref_grouped_detail(logits, k, num_groups, topk_groups, bias=None, renormalize=True, scale=1.0):
    """DeepSeek-V3 (sigmoid, top2-sum) per token: ({expert id: weight}, set of kept group indices)."""
    details = ref_grouped_topk_detail(
        logits,
        k,
        num_groups,
        topk_groups,
        scoring="sigmoid",
        group_score="top2-sum",
        bias=bias,
        renormalize=renormalize,
        scale=scale,
    )
    return [(d, kept) for d, kept, _ in details]


def ref_grouped(logits, k, num_groups, topk_groups, bias=None, renormalize=True, scale=1.0):
    """DeepSeek-V3 (sigmoid, top2-sum) per token: {expert id: weight}."""
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


def assert_matches_where_decided(
    r: Routing,
    expected: list[dict[int, float]],
    margins: list[float],
    k: int,
    *,
    tol: float = 2e-6,
    min_margin: float = 1e-6,
    max_undecided: float = 0.01,
) -> None:
    """`assert_matches` on the tokens whose reference choice is decided by more than `min_margin`
    (a near-tie can go either way in fp32); at most `max_undecided` of the tokens may be left out."""
    keep = [t for t, m in enumerate(margins) if m > min_margin]
    assert len(keep) >= (1 - max_undecided) * len(margins), f"{len(margins) - len(keep)} near-tied tokens"
    index = torch.tensor(keep, dtype=torch.int64)
    sub = Routing(r.topk_ids.index_select(0, index), r.topk_weights.index_select(0, index))
    assert_matches(sub, [expected[t] for t in keep], k, tol=tol)


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
