"""Where experts live: physical expert slots, replicas of busy experts, and a balanced placement.

A layer with `R` redundant experts holds `P = E + R` physical slots (split evenly over the
expert-parallel ranks, `P / ep` per rank); every logical expert has at least one slot and a busy
one may have several. Routing picks logical experts; `ExpertPlacement.to_physical` then sends each
(token, slot) pair to one replica of its expert, by (token + j) modulo the expert's replica count: deterministic,
giving each replica an equal share of an expert's tokens on average.
The map lives in two device tensors whose shapes never change, so a new placement is copied into
them in place (captured graphs keep working).

`balanced_placement` places replicas to minimise the busiest rank's load given per-expert loads
(see its docstring); `greedy_placement` is the simple baseline it is compared with.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hal import InvalidInput, invalid, positive_int
from moe.arguments import as_device


@dataclass(frozen=True)
class ExpertPlacement:
    """`slots[p]`: the logical expert physical slot p holds (length P = E + R); rank r holds slots
    `[r * P / ranks, (r + 1) * P / ranks)`."""

    slots: tuple[int, ...]
    num_experts: int

    def __post_init__(self) -> None:
        positive_int("num_experts", self.num_experts)
        if isinstance(self.slots, (str, bytes, Mapping)) or not isinstance(self.slots, (Sequence, range)):
            raise invalid("slots", "a sequence of logical expert ids, one per physical slot", type(self.slots).__name__)
        slots = tuple(self.slots)
        if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.num_experts for s in slots):
            raise invalid("slots", f"logical expert ids in [0, {self.num_experts})", slots)
        missing = sorted(set(range(self.num_experts)) - set(slots))
        if missing:
            raise InvalidInput(f"slots: expected every logical expert in at least one slot, missing {missing[:8]}")
        object.__setattr__(self, "slots", slots)

    @classmethod
    def default(cls, num_experts: int, redundant: int = 0) -> ExpertPlacement:
        """Expert e in slot e; the `redundant` extra slots replicate experts 0, 1, ... in turn."""
        positive_int("num_experts", num_experts)
        if isinstance(redundant, bool) or not isinstance(redundant, int) or redundant < 0:
            raise invalid("redundant_experts", "an int >= 0", redundant)
        return cls(tuple(range(num_experts)) + tuple(r % num_experts for r in range(redundant)), num_experts)

    @property
    def num_physical(self) -> int:
        """P, the physical slots."""
        return len(self.slots)

    @property
    def redundant(self) -> int:
        """R = P - E."""
        return self.num_physical - self.num_experts

    def replicas(self, expert: int) -> list[int]:
        """The physical slots holding logical `expert`, in slot order."""
        if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise invalid("expert", f"a logical expert id in [0, {self.num_experts})", expert)
        return [p for p, e in enumerate(self.slots) if e == expert]

    def rank_loads(self, load: Sequence[float], ranks: int) -> list[float]:
        """Each rank's load when logical expert e carries `load[e]`, split evenly over its replicas."""
        per_slot = self.slot_loads(load)
        width = slots_per_rank(self.num_physical, ranks)
        return [sum(per_slot[r * width : (r + 1) * width]) for r in range(ranks)]

    def slot_loads(self, load: Sequence[float]) -> list[float]:
        """Each physical slot's share of its expert's load."""
        load = _checked_load(load, self.num_experts)
        counts = [0] * self.num_experts
        for e in self.slots:
            counts[e] += 1
        return [float(load[e]) / counts[e] for e in self.slots]

    def tables(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(replica_table [E, R + 1], replica_count [E])` int64: the slots of each expert (padded by
        repeating its first) and how many there are."""
        device = as_device("device", device, optional=True)
        width = self.redundant + 1
        table = torch.zeros(self.num_experts, width, dtype=torch.int64)
        count = torch.zeros(self.num_experts, dtype=torch.int64)
        for e in range(self.num_experts):
            slots = self.replicas(e)
            if len(slots) > width:
                raise InvalidInput(f"expert {e}: {len(slots)} replicas, more than the {width} slots of the table")
            table[e] = torch.tensor(slots + [slots[0]] * (width - len(slots)))
            count[e] = len(slots)
        return (table, count) if device is None else (table.to(device), count.to(device))


class PhysicalMap:
    """A placement as device tensors: logical top-k ids to physical slots, updated in place."""

    def __init__(self, placement: ExpertPlacement, device: torch.device | str) -> None:
        self.placement = placement
        self.table, self.count = placement.tables(device)

    def update(self, placement: ExpertPlacement) -> None:
        """Take a new placement of the same E and P (copied into the same tensors)."""
        if (placement.num_experts, placement.num_physical) != (self.placement.num_experts, self.placement.num_physical):
            raise invalid(
                "placement",
                f"one of {self.placement.num_experts} experts over {self.placement.num_physical} slots",
                f"{placement.num_experts} over {placement.num_physical}",
            )
        table, count = placement.tables(self.table.device)
        self.table.copy_(table)
        self.count.copy_(count)
        self.placement = placement

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Physical slots `[T, k]` (int64) for logical `topk_ids` `[T, k]`: token t's j-th choice e goes to
        replica `(t + j) mod count[e]`; a token picks an expert once, so consecutive tokens choosing e
        take its replicas in turn, whichever slot j it holds in their top-k."""
        ids = topk_ids.to(torch.int64)
        t, k = ids.shape
        order = torch.arange(t, device=ids.device, dtype=torch.int64).view(t, 1) + torch.arange(
            k, device=ids.device, dtype=torch.int64
        ).view(1, k)
        choice = torch.remainder(order, self.count[ids])
        return self.table[ids, choice]


def slots_per_rank(num_physical: int, ranks: int) -> int:
    """The physical slots each of `ranks` ranks holds, or `InvalidInput` where they do not divide evenly."""
    positive_int("ranks", ranks)
    if num_physical % ranks:
        raise InvalidInput(f"placement: expected slots ({num_physical}) divisible by the ranks ({ranks})")
    return num_physical // ranks


def _checked_load(load: object, num_experts: int | None = None) -> list[float]:
    """`load` as floats: a 1-D sequence or tensor of finite, non-negative real numbers (no bools), one per
    expert (`num_experts` of them where given), else `InvalidInput` naming `load`."""
    expected = f"{num_experts if num_experts is not None else 'one or more'} finite, non-negative per-expert loads"
    if isinstance(load, torch.Tensor):
        if load.dim() != 1 or load.is_meta or load.is_complex() or load.dtype == torch.bool:
            raise invalid(
                "load", f"{expected} (a 1-D real tensor with data)", f"{load.dtype} tensor {tuple(load.shape)}"
            )
        load = load.tolist()
    elif hasattr(load, "ndim") and hasattr(load, "tolist"):  # numpy arrays and the like
        if load.ndim != 1:
            raise invalid("load", f"{expected} (1-D)", f"an array of shape {tuple(load.shape)}")
        load = load.tolist()
    if isinstance(load, (str, bytes, Mapping)) or not isinstance(load, Sequence):
        raise invalid("load", f"{expected} (a sequence)", type(load).__name__)
    bad = [v for v in load if isinstance(v, bool) or not isinstance(v, numbers.Real)]
    if bad:
        raise invalid("load", f"{expected} (real numbers, not bools)", bad[:8])
    try:
        values = [float(v) for v in load]
    except OverflowError:
        raise invalid("load", f"{expected} (within the float range)", list(load)[:8]) from None
    wrong = len(values) != num_experts if num_experts is not None else not values
    if wrong or any(not (math.isfinite(v) and v >= 0.0) for v in values):
        raise invalid("load", expected, values[:8] if not wrong else f"{len(values)} loads {values[:8]}")
    return values


def _checked_slots(num_physical: object, num_experts: int, ranks: object) -> int:
    """`num_physical` checked against the experts and the ranks; returns the slots per rank."""
    positive_int("num_physical", num_physical)
    if num_physical < num_experts:  # type: ignore[operator]
        raise InvalidInput(f"placement: expected at least one slot per expert ({num_experts}), got {num_physical}")
    return slots_per_rank(num_physical, ranks)  # type: ignore[arg-type]


def greedy_placement(load: Sequence[float], num_physical: int, ranks: int) -> ExpertPlacement:
    """The baseline: one replica more for each of the R busiest experts, slots filled in expert order."""
    values = _checked_load(load)
    e = len(values)
    _checked_slots(num_physical, e, ranks)
    busiest = sorted(range(e), key=lambda x: (-values[x], x))
    extra = [busiest[r % e] for r in range(num_physical - e)]
    return ExpertPlacement(tuple(sorted(list(range(e)) + extra)), e)


def balanced_placement(load: Sequence[float], num_physical: int, ranks: int) -> ExpertPlacement:
    """Replicas and their ranks chosen to minimise the busiest rank's load.

    Objective: with expert e's load `load[e]` split evenly over its `n_e` replicas, `sum(n_e) = P`
    and `P / ranks` slots per rank, minimise max over ranks of the summed replica loads. Two steps:
    replicas go, one at a time, to the expert whose replicas are currently the heaviest (this
    minimises the heaviest replica, a lower bound of any placement's busiest rank); then replicas
    are placed heaviest first on the least-loaded rank with a free slot (longest-processing-time
    scheduling under slot capacities), and a pass of pairwise swaps between the busiest rank and
    the others keeps any swap that lowers the busiest rank's load.
    """
    values = _checked_load(load)
    e = len(values)
    width = _checked_slots(num_physical, e, ranks)
    counts = [1] * e
    heap = [(-values[x], x) for x in range(e)]
    heapq.heapify(heap)
    for _ in range(num_physical - e):
        _, x = heapq.heappop(heap)
        counts[x] += 1
        heapq.heappush(heap, (-values[x] / counts[x], x))
    replicas = sorted(
        ((values[x] / counts[x], x) for x in range(e) for _ in range(counts[x])), key=lambda r: (-r[0], r[1])
    )
    bins: list[list[tuple[float, int]]] = [[] for _ in range(ranks)]
    totals = [0.0] * ranks
    for weight, x in replicas:
        # the least-loaded rank with room; among equals, one without this expert yet (replicas apart)
        open_ranks = [r for r in range(ranks) if len(bins[r]) < width]
        r = min(open_ranks, key=lambda q: (totals[q], any(y == x for _, y in bins[q]), q))
        bins[r].append((weight, x))
        totals[r] += weight
    _swap_pass(bins, totals)
    slots = [x for b in bins for _, x in sorted(b, key=lambda item: item[1])]
    return ExpertPlacement(tuple(slots), e)


def _swap_pass(bins: list[list[tuple[float, int]]], totals: list[float]) -> None:
    """Swap a replica of the busiest rank with a lighter one elsewhere while that lowers the maximum."""
    for _ in range(4 * sum(len(b) for b in bins)):
        top = max(range(len(bins)), key=lambda r: totals[r])
        best = None
        for r in range(len(bins)):
            if r == top:
                continue
            for i, (a, _) in enumerate(bins[top]):
                for j, (b, _) in enumerate(bins[r]):
                    delta = a - b
                    if delta <= 0:
                        continue
                    new_max = max(totals[top] - delta, totals[r] + delta)
                    if new_max < totals[top] - 1e-12 and (best is None or new_max < best[0]):
                        best = (new_max, r, i, j, delta)
        if best is None:
            return
        _, r, i, j, delta = best
        bins[top][i], bins[r][j] = bins[r][j], bins[top][i]
        totals[top] -= delta
        totals[r] += delta


__all__ = ["ExpertPlacement", "PhysicalMap", "balanced_placement", "greedy_placement"]
