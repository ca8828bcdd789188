"""`hal.reference.sort_received` / `reduce_received` (the experts' side of token-wise expert parallelism)
against a dense float64 MoE: random routing, top-1 to top-8, 1 to 4 ranks, normal (exact and padded row
index) and masked layouts. Rows that must never be read are NaN, so reading one fails the comparison."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from hal.reference import ReceivedTokens, reduce_received, sort_by_expert, sort_received, weighted_combine

SortFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]]
CombineFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.dtype], torch.Tensor]

HIDDEN = 16
MODES = ("normal", "normal-padded", "masked")


@dataclasses.dataclass
class World:
    """Every rank's tokens, routing and the experts (one float64 matrix each)."""

    x: list[torch.Tensor]
    ids: list[torch.Tensor]
    weights: list[torch.Tensor]
    experts: torch.Tensor  # [E, H, H]
    local: int

    @property
    def ranks(self) -> int:
        return len(self.x)


def make_world(seed: int, ranks: int, top_k: int) -> World:
    g = torch.Generator().manual_seed(seed)
    local = max(2, math.ceil(top_k / ranks)) + 1
    experts = ranks * local
    tokens = [int(torch.randint(0, 7, (1,), generator=g)) for _ in range(ranks)]
    x = [torch.randn(t, HIDDEN, generator=g, dtype=torch.float64) for t in tokens]
    ids = [
        torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(t)])
        if t
        else torch.empty(0, top_k, dtype=torch.int64)
        for t in tokens
    ]
    weights = [torch.rand(t, top_k, generator=g, dtype=torch.float64) + 0.1 for t in tokens]
    return World(x, ids, weights, torch.randn(experts, HIDDEN, HIDDEN, generator=g, dtype=torch.float64), local)


def dense(world: World) -> list[torch.Tensor]:
    """Each rank's output: sum over slots of weight * x @ expert, in float64."""
    out = []
    for x, ids, w in zip(world.x, world.ids, world.weights):
        rows = torch.einsum("th,tkhj->tkj", x, world.experts[ids])
        out.append((rows * w.unsqueeze(-1)).sum(dim=1))
    return out


def received_by(world: World, rank: int) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `rank` receives from a token-wise dispatcher: (source, token) in source then token order, their
    rows, local ids (-1 where another rank holds the expert) and weights as sent."""
    first = rank * world.local
    sources, rows, local_ids, weights = [], [], [], []
    for s in range(world.ranks):
        for t in range(world.x[s].shape[0]):
            ids = world.ids[s][t]
            here = (ids >= first) & (ids < first + world.local)
            if here.any():
                sources.append((s, t))
                rows.append(world.x[s][t])
                local_ids.append(torch.where(here, ids - first, -1))
                weights.append(world.weights[s][t])
    k = world.ids[0].shape[1]
    if not sources:
        return (
            [],
            torch.zeros(0, HIDDEN, dtype=torch.float64),
            torch.zeros(0, k, dtype=torch.int64),
            torch.zeros(0, k, dtype=torch.float64),
        )
    return sources, torch.stack(rows), torch.stack(local_ids), torch.stack(weights)


def expert_rows(
    world: World, rank: int, recv_x: torch.Tensor, received: ReceivedTokens, mode: str, slots: int | None
) -> torch.Tensor:
    """The experts' output for the row index: valid rows computed, every other row NaN."""
    counts = received.expert_counts
    first = rank * world.local
    if mode == "masked":
        out = torch.full((world.local, slots, HIDDEN), float("nan"), dtype=torch.float64)
        index = received.row_index.view(world.local, slots)
        for e in range(world.local):
            n = int(counts[e])
            out[e, :n] = recv_x[index[e, :n]] @ world.experts[first + e]
        return out
    valid = int(counts.sum())
    out = torch.full((received.row_index.numel(), HIDDEN), float("nan"), dtype=torch.float64)
    expert_of_row = torch.repeat_interleave(torch.arange(world.local), counts)
    rows = recv_x[received.row_index[:valid]]
    out[:valid] = torch.einsum("ph,phj->pj", rows, world.experts[first + expert_of_row])
    return out


def round_trip(
    world: World,
    mode: str,
    *,
    corrupt: Callable[[ReceivedTokens], ReceivedTokens] | None = None,
    sort: SortFn | None = None,
    combine: CombineFn | None = None,
) -> float:
    """Max |ep - dense| / max |dense| over all ranks' tokens, after sorting, the experts and reducing."""
    out = [torch.zeros_like(x) for x in world.x]
    slots = max(1, max(x.shape[0] for x in world.x)) * world.ranks if mode == "masked" else None
    for rank in range(world.ranks):
        sources, recv_x, local_ids, weights = received_by(world, rank)
        here = (local_ids >= 0).sum(dim=0)
        pairs = int(here.sum())
        received = sort_received(
            local_ids, weights, world.local, rows=pairs if mode == "normal" else None, slots=slots, sort=sort
        )
        check_sorted(world, rank, local_ids, received, mode, slots)
        if corrupt is not None:
            received = corrupt(received)
        partial = reduce_received(
            expert_rows(world, rank, recv_x, received, mode, slots), received, torch.float64, combine=combine
        )
        assert partial.shape == (len(sources), HIDDEN)
        for j, (s, t) in enumerate(sources):
            out[s][t] += partial[j]
    ref = dense(world)
    scale = max((r.abs().max().item() for r in ref if r.numel()), default=1.0)
    return max(((o - r).abs().max().item() for o, r in zip(out, ref) if r.numel()), default=0.0) / scale


def check_sorted(
    world: World, rank: int, local_ids: torch.Tensor, received: ReceivedTokens, mode: str, slots: int | None
) -> None:
    """Counts per local expert, and each expert's rows in received-token order."""
    expected = (
        torch.stack([(local_ids == e).sum() for e in range(world.local)])
        if local_ids.numel()
        else torch.zeros(world.local, dtype=torch.int64)
    )
    assert torch.equal(received.expert_counts, expected)
    assert received.combine_weights.dtype == torch.float32
    starts = torch.cumsum(expected, 0) - expected
    for e in range(world.local):
        n = int(expected[e])
        rows = (
            received.row_index.view(world.local, slots)[e, :n]
            if mode == "masked"
            else received.row_index[int(starts[e]) : int(starts[e]) + n]
        )
        want = torch.nonzero((local_ids == e).any(dim=1)).flatten() if n else rows
        assert torch.equal(rows, want), (e, rows, want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("top_k", [1, 2, 3, 5, 8])
def test_round_trip_matches_the_dense_moe(mode, ranks, top_k):
    for seed in range(4):
        world = make_world(seed * 100 + ranks * 10 + top_k, ranks, top_k)
        assert round_trip(world, mode) < 1e-5, (mode, ranks, top_k, seed)


@pytest.mark.parametrize("mode", MODES)
def test_the_vendor_hooks_are_used(mode):
    calls = {"sort": 0, "combine": 0}

    def sort(ids, n):  # type: ignore[no-untyped-def]
        calls["sort"] += 1
        return sort_by_expert(ids, n)

    def combine(rows, index, weights, out_dtype):  # type: ignore[no-untyped-def]
        calls["combine"] += 1
        return weighted_combine(rows.float(), index, weights, torch.float32).to(out_dtype)

    world = make_world(7, 3, 4)
    assert round_trip(world, mode, sort=sort, combine=combine) < 1e-5
    assert calls["sort"] == 3 and calls["combine"] >= 1


@pytest.mark.parametrize("mode", MODES)
def test_the_comparison_catches_wrong_weights_and_rows(mode):
    """The checker is not vacuous: weights that ignore locality, or rows shifted by one, break it."""
    world = make_world(11, 2, 4)

    def unit_weights(r: ReceivedTokens) -> ReceivedTokens:
        return dataclasses.replace(r, combine_weights=torch.ones_like(r.combine_weights))

    def shifted(r: ReceivedTokens) -> ReceivedTokens:
        return dataclasses.replace(r, combine_index=torch.roll(r.combine_index, 1))

    assert round_trip(world, mode) < 1e-5
    for corrupt in (unit_weights, shifted):
        error = round_trip(world, mode, corrupt=corrupt)
        assert not error < 1e-2, corrupt.__name__  # a large error, or NaN from a row that must not be read


def test_out_of_range_ids_count_as_other_ranks():
    """Any id outside [0, L) (another rank's expert, an empty slot) is left out and weighs 0."""
    ids = torch.tensor([[0, 5, -1], [-3, 1, 1]])
    weights = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.3, 0.6]])
    received = sort_received(ids, weights, 2)
    assert received.expert_counts.tolist() == [1, 2]
    assert received.row_index[:3].tolist() == [0, 1, 1]
    assert torch.allclose(received.combine_weights, torch.tensor([[0.5, 0, 0], [0, 0.3, 0.6]]))
