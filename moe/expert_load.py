"""Per-expert load statistics, recorded on the device without a host synchronisation.

A layer built with `load_stats=LoadStats(window=W)` counts, at every forward, how many (token, slot)
pairs chose each logical expert (this rank's tokens) and how many pairs each of this rank's
physical slots received: cumulative counts and a sliding window of the last W forwards. The
counters are fixed-size device tensors that the vendor's `accumulate_counts` updates in place (one
or two small kernels per count on CUDA, a step counter kept on the device), so recording needs no
host read and works inside captured graphs. Memory is bounded: `(W + 2) * (E + L)` int64 counters.

Reading (`ExpertLoad.snapshot`) copies the counters to the host (one synchronisation, when asked).
Statistics of calls issued concurrently from several streams may miss updates.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hal import InvalidInput, invalid, positive_int

if TYPE_CHECKING:
    from hal import Vendor


@dataclass(frozen=True)
class LoadStats:
    """What a layer records: `window` forwards in the sliding window (the cumulative counts are always kept)."""

    window: int = 64

    def __post_init__(self) -> None:
        positive_int("LoadStats.window", self.window)


@dataclass(frozen=True)
class LoadSnapshot:
    """Counts read back to the host: per logical expert (this rank's tokens, or every rank's where
    gathered) and per local physical slot, cumulative and over the window."""

    forwards: int
    window_forwards: int
    expert_total: list[int]
    expert_window: list[int]
    slot_total: list[int]
    slot_window: list[int]
    ranks: int = 1

    @property
    def imbalance(self) -> float | None:
        """max / mean of the window's per-expert counts (1.0: perfectly even; None: nothing recorded)."""
        return _max_over_mean(self.expert_window)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {
            "forwards": self.forwards,
            "window_forwards": self.window_forwards,
            "ranks": self.ranks,
            "imbalance": self.imbalance,
            "expert_total": self.expert_total,
            "expert_window": self.expert_window,
            "slot_total": self.slot_total,
            "slot_window": self.slot_window,
        }


def _max_over_mean(values: list[int]) -> float | None:
    total = sum(values)
    return None if not values or total == 0 else max(values) / (total / len(values))


class ExpertLoad(torch.nn.Module):
    """A layer's load counters on its device (see the module); buffers that move with the layer and
    stay out of its `state_dict`."""

    expert_total: torch.Tensor
    expert_recent: torch.Tensor
    slot_total: torch.Tensor
    slot_recent: torch.Tensor
    step: torch.Tensor
    slot_step: torch.Tensor

    def __init__(self, config: LoadStats, num_experts: int, local_slots: int, vendor: Vendor) -> None:
        super().__init__()
        self.config = config
        self.vendor = vendor
        rows = config.window + 1  # a ring: the row after the newest is kept zero
        make = {"dtype": torch.int64, "device": vendor.device}
        counters = (rows + 1) * (num_experts + local_slots)
        for name, shape in (
            ("expert_total", (num_experts,)),
            ("expert_recent", (rows, num_experts)),
            ("slot_total", (local_slots,)),
            ("slot_recent", (rows, local_slots)),
            ("step", (1,)),  # forwards recorded (on the device: never read per call)
            ("slot_step", (1,)),
        ):
            try:
                self.register_buffer(name, torch.zeros(shape, **make), persistent=False)
            except RuntimeError as exc:  # out of memory (torch.OutOfMemoryError is one)
                raise invalid(
                    "load_stats.window",
                    f"a window whose {counters} int64 counters fit in {vendor.device} memory",
                    config.window,
                ) from exc

    def record_routing(self, topk_ids: torch.Tensor) -> None:
        """Count a forward's logical choices `[T, k]`."""
        self.vendor.accumulate_counts(topk_ids.reshape(-1), self.expert_total, self.expert_recent, self.step, ids=True)

    def record_received(self, slot_counts: torch.Tensor) -> None:
        """Count the pairs each local slot received in a forward (`[L]`, the dispatch's expert counts)."""
        self.vendor.accumulate_counts(slot_counts, self.slot_total, self.slot_recent, self.slot_step, ids=False)

    def reset(self) -> None:
        """Zero every counter."""
        for t in self.buffers():
            t.zero_()

    def saved(self) -> Callable[[], None]:
        """The function that puts every counter back to its present value (around a graph capture,
        whose warm-up runs are no forwards of the caller's)."""
        kept = [(t, t.clone()) for t in self.buffers()]

        def restore() -> None:
            for t, value in kept:
                t.copy_(value)

        return restore

    def snapshot(self, process_group: Any = None) -> LoadSnapshot:
        """The counters on the host; with `process_group`, the per-expert counts summed over its ranks
        (a collective: every rank calls it)."""
        from moe.dispatch.base import group_size_and_rank

        ranks = group_size_and_rank(process_group)[0]  # refuses a wrong object or a group this rank is not in
        expert_total, expert_window = self.expert_total.clone(), self.expert_recent.sum(dim=0)
        if process_group is not None:
            import torch.distributed as dist

            both = torch.stack([expert_total, expert_window])
            dist.all_reduce(both, group=process_group)
            expert_total, expert_window = both[0], both[1]
        forwards = int(self.step.item())
        return LoadSnapshot(
            forwards=forwards,
            window_forwards=min(forwards, self.config.window),
            expert_total=expert_total.tolist(),
            expert_window=expert_window.tolist(),
            slot_total=self.slot_total.tolist(),
            slot_window=self.slot_recent.sum(dim=0).tolist(),
            ranks=ranks,
        )


def dump_expert_load(layers: Mapping[str, Any] | Iterable[tuple[str, Any]], path: str | Path | None = None) -> dict:
    """Every named layer's snapshot (layers without statistics are skipped) as one JSON document
    `{"layers": {name: snapshot}}`, written to `path` when given. `model.named_modules()` works as
    `layers`. With expert parallelism every rank must call it (the counts are gathered)."""
    items = layers.items() if isinstance(layers, Mapping) else layers
    expected = "a mapping or iterable of (name, module) pairs, e.g. model.named_modules()"
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise invalid("layers", expected, type(layers).__name__)
    out: dict[str, Any] = {"layers": {}}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise invalid("layers", expected, f"an item of type {type(item).__name__}")
        name, layer = item
        load = getattr(layer, "expert_load", None)
        if not isinstance(load, ExpertLoad):
            continue
        snap = load.snapshot(getattr(layer, "process_group", None))
        entry = snap.as_dict()
        placement = getattr(layer, "placement", None)
        if placement is not None and snap.ranks > 1:
            entry["rank_load"] = placement.rank_loads(snap.expert_window, snap.ranks)
            entry["rank_imbalance"] = _max_over_mean([round(v) for v in entry["rank_load"]])
        entry["placement"] = None if placement is None else list(placement.slots)
        out["layers"][name or "<root>"] = entry
    if path is not None:
        Path(path).write_text(json.dumps(out, indent=1) + "\n")
    return out


def summarize(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per layer of a `dump_expert_load` document: forwards, pairs in the window, the
    per-expert imbalance (max / mean) and, under expert parallelism, the per-rank one."""
    layers = document.get("layers") if isinstance(document, Mapping) else None
    if not isinstance(layers, Mapping):
        if not isinstance(document, Mapping):
            given = f"a {type(document).__name__}"
        else:
            given = '"layers" missing' if "layers" not in document else f'"layers" of type {type(layers).__name__}'
        raise invalid("expert load document", 'a JSON object with a "layers" object', given)
    rows = []
    for name, entry in layers.items():
        try:
            window = [_count(v) for v in entry["expert_window"]]
            _count(entry["forwards"])
            rows.append(
                {
                    "layer": name,
                    "forwards": int(entry["forwards"]),
                    "pairs": sum(window),
                    "imbalance": _max_over_mean(window),
                    "hottest": max(range(len(window)), key=window.__getitem__) if window else None,
                    "rank_imbalance": _ratio(entry.get("rank_imbalance")),
                }
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise InvalidInput(f"expert load document: layer {name!r} is malformed ({exc})") from None
    return rows


def _ratio(value: object) -> float | None:
    """A recorded imbalance: None or a finite number >= 0, else ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"expected rank_imbalance None or a finite number >= 0, got {value!r}")
    return float(value)


def _count(value: object) -> int:
    """A recorded count: a whole number >= 0 (JSON floats such as 3.0 included), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise ValueError(f"expected counts that are whole numbers >= 0, got {value!r}")
    return int(value)


__all__ = ["ExpertLoad", "LoadSnapshot", "LoadStats", "dump_expert_load", "summarize"]
