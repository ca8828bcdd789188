"""Moving experts to a new placement, in place, over torch.distributed.

Every rank computes the same transfer plan from the old and the new placement: a slot whose
expert is already there stays; otherwise it copies a current replica, preferring one on its own
rank, else the lowest slot holding that expert. Slots arriving from another rank come through
`batch_isend_irecv` (one message per peer and buffer), slots of the same rank through an index;
every source is read before any slot is written, and the results are copied into the layer's
existing buffers (nothing is reallocated). Expert weights, scales and biases move; tensors that
belong to the whole layer (one-element global scales) stay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hal import InvalidInput, invalid
from moe.dispatch.base import group_size_and_rank
from moe.placement import ExpertPlacement, PhysicalMap, slots_per_rank, balanced_placement

if TYPE_CHECKING:
    from moe.layer import MoELayer


def transfer_plan(old: ExpertPlacement, new: ExpertPlacement, ranks: int) -> list[tuple[int, int]]:
    """`(source slot, destination slot)` for every destination slot of `new` whose expert is not already
    there, as global slot ids; the same on every rank."""
    for name, placement in (("old", old), ("new", new)):
        if not isinstance(placement, ExpertPlacement):
            raise invalid(name, "a moe.ExpertPlacement", type(placement).__name__)
    _same_shape(old, new)
    width = slots_per_rank(new.num_physical, ranks)
    holders: dict[int, list[int]] = {}
    for slot, expert in enumerate(old.slots):
        holders.setdefault(expert, []).append(slot)
    plan = []
    for slot, expert in enumerate(new.slots):
        if old.slots[slot] == expert:
            continue
        sources = holders[expert]
        near = [s for s in sources if s // width == slot // width]
        plan.append((near[0] if near else sources[0], slot))
    return plan


def migrate(layer: MoELayer, new: ExpertPlacement) -> int:
    """Move `layer`'s experts to `new` (see the module); every rank of its process group calls it with the
    same placement. Returns the number of slots this rank received from other ranks."""
    old = layer.placement
    if not layer.scheme.traits.movable_experts:
        raise InvalidInput(
            f"placement: scheme {layer.scheme.name!r} does not declare movable_experts, so its experts cannot move"
        )
    weights = layer.experts.weights
    if weights is None:
        raise InvalidInput("placement: expected a layer with weights loaded")
    ranks, rank = group_size_and_rank(layer.process_group)
    _same_on_every_rank(layer.process_group, old, new, ranks, _weights_device(layer))
    width = old.num_physical // ranks
    buffers = _moving_buffers(layer, width)
    plan = transfer_plan(old, new, ranks)
    mine = range(rank * width, (rank + 1) * width)
    incoming = [(s, d) for s, d in plan if d in mine and s not in mine]
    outgoing = [(s, d) for s, d in plan if s in mine and d not in mine]
    local = [(s, d) for s, d in plan if s in mine and d in mine]
    received = _exchange(layer.process_group, buffers, incoming, outgoing, width, rank)
    staged = {name: t[[s - rank * width for s, _ in local]].clone() for name, t in buffers.items()} if local else {}
    with torch.no_grad():
        for name, t in buffers.items():
            if local:
                t[[d - rank * width for _, d in local]] = staged[name]
            for (_, dest), rows in zip(_by_peer(incoming, width), received.get(name, [])):
                t[[d - rank * width for d in dest]] = rows
    layer.apply_placement(new)
    return len(incoming)


def _weights_device(layer: MoELayer) -> torch.device:
    """The device of the layer's expert buffers (the vendor's device where it has none)."""
    return next((t.device for t in layer.experts.buffers()), torch.device(layer.vendor.device))


def _same_shape(old: ExpertPlacement, new: ExpertPlacement) -> None:
    if (new.num_experts, new.num_physical) != (old.num_experts, old.num_physical):
        raise invalid(
            "placement",
            f"{old.num_experts} experts over {old.num_physical} slots",
            f"{new.num_experts} experts over {new.num_physical} slots",
        )


def _same_on_every_rank(group: Any, old: ExpertPlacement, new: object, ranks: int, device: torch.device) -> None:
    """Refuse, on every rank alike, a placement that is invalid on any rank or differs between them (their
    transfers would not match: a hang or experts in the wrong slots). One small all-gather of a validity flag
    and the slots, on the weights' device (where the migration's own transfers go), before any rank raises,
    so that no rank is left waiting in a collective its peers never join."""
    try:
        if not isinstance(new, ExpertPlacement):
            raise invalid("placement", "a moe.ExpertPlacement", type(new).__name__)
        _same_shape(old, new)
        problem = None
    except InvalidInput as exc:
        problem = exc
    if ranks == 1:
        if problem is not None:
            raise problem
        return
    import torch.distributed as dist

    mine = torch.full((old.num_physical + 1,), -1, dtype=torch.int64)
    if problem is None:
        mine[0] = 0
        mine[1:] = torch.tensor(new.slots, dtype=torch.int64)  # type: ignore[union-attr]
    gathered = [torch.empty_like(mine, device=device) for _ in range(ranks)]
    dist.all_gather(gathered, mine.to(device), group=group)
    rows = [g.cpu() for g in gathered]
    if problem is not None:
        raise InvalidInput(f"{problem} (refused on every rank of the process group)") from problem
    invalid_on = [r for r, row in enumerate(rows) if row[0] != 0]
    if invalid_on:
        raise InvalidInput(
            f"placement: expected a valid placement on every rank, got an invalid one on rank(s) {invalid_on}"
        )
    differing = [r for r, row in enumerate(rows) if not torch.equal(row, rows[0])]
    if differing:
        raise InvalidInput(
            f"placement: expected the same placement on every rank of the process group, got another one on "
            f"rank(s) {differing} than on rank 0"
        )


def _moving_buffers(layer: MoELayer, width: int) -> dict[str, torch.Tensor]:
    """The expert store's per-expert buffers (leading dimension: the local slots); refuses any other
    tensor that is not one value for the whole layer."""
    moving = {}
    for name, t in layer.experts.named_buffers():
        if t.dim() >= 1 and t.shape[0] == width:
            moving[name] = t
        elif t.numel() != 1:
            raise InvalidInput(
                f"placement: expert tensor {name} {tuple(t.shape)} has neither the local experts ({width}) first "
                "nor one value for the layer, so it cannot move"
            )
    return dict(sorted(moving.items()))


def _by_peer(pairs: list[tuple[int, int]], width: int) -> list[tuple[int, list[int]]]:
    """`pairs` grouped by the peer rank of their source, in rank order: (peer, destination slots)."""
    peers: dict[int, list[int]] = {}
    for source, dest in pairs:
        peers.setdefault(source // width, []).append(dest)
    return sorted(peers.items())


def _exchange(
    group: Any,
    buffers: dict[str, torch.Tensor],
    incoming: list[tuple[int, int]],
    outgoing: list[tuple[int, int]],
    width: int,
    rank: int,
) -> dict[str, list[torch.Tensor]]:
    """Send this rank's source slots to the ranks that need them and receive its own, per buffer."""
    if not incoming and not outgoing:
        return {}
    import torch.distributed as dist

    sends: dict[int, list[int]] = {}
    for source, dest in outgoing:
        sends.setdefault(dest // width, []).append(source - rank * width)
    recvs = _by_peer(incoming, width)
    ops, received = [], {}
    for name, t in buffers.items():
        for peer, slots in sorted(sends.items()):
            ops.append(dist.P2POp(dist.isend, t[slots].contiguous(), _global(group, peer), group))
        received[name] = []
        for peer, dest in recvs:
            rows = torch.empty((len(dest), *t.shape[1:]), dtype=t.dtype, device=t.device)
            received[name].append(rows)
            ops.append(dist.P2POp(dist.irecv, rows, _global(group, peer), group))
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _global(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


class Rebalancing:
    """The `MoELayer` methods that place its experts (`redundant_experts`, `rebalance`)."""

    @property
    def local_logical_experts(self: Any) -> tuple[int, ...]:
        """The logical expert each of this rank's slots holds, in slot order (what its weights are)."""
        return tuple(self.placement.slots[p] for p in self.local_experts)

    def rebalance(self: Any, placement: ExpertPlacement | None = None) -> ExpertPlacement:
        """Move the experts to `placement`, or to `moe.balanced_placement` of the recorded load (the
        window's per-expert counts, summed over the process group); between forwards, in place, the
        output unchanged. Every rank of the process group calls it. Returns the placement taken."""
        if placement is None:
            if self.expert_load is None:
                raise InvalidInput("rebalance: expected a placement, or a layer built with load_stats=moe.LoadStats()")
            load = self.expert_load.snapshot(self.process_group).expert_window
            ranks = group_size_and_rank(self.process_group)[0]
            placement = balanced_placement(load, self.num_physical_experts, ranks)
        migrate(self, placement)
        return placement

    def apply_placement(self: Any, placement: ExpertPlacement) -> None:
        """Take `placement` as the map from logical experts to slots, for weights already where it says
        (`moe.migration.migrate` moves them first)."""
        if self._physical is None:
            self._physical = PhysicalMap(placement, self.vendor.device)
        else:
            self._physical.update(placement)
        self.placement = placement
        self.experts.changed()


__all__ = ["Rebalancing", "migrate", "transfer_plan"]
