"""This rank's place in the world: joining it, the group the cases run on, and agreeing on outcomes.

The ranks join the default process group with the vendor's collective backend, then make two
groups: a gloo group on the host for control (every case's outcome is gathered there) and a data
group, the vendor's backend, that the layers of the cases use. A rank whose case raised drops its
data group at once, so peers blocked in a collective with it fail instead of waiting for the
timeout; when any rank failed a case, every rank makes a fresh data group before the next one,
so one failure never leaves the ranks out of step. Making a group connects every pair of ranks;
on a loaded host that connection can fail on one rank, so the ranks agree on each attempt and
make it again together (`DATA_GROUP_ATTEMPTS`) instead of one rank stopping the run.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: how many times the ranks together try to make a data group before the run stops
DATA_GROUP_ATTEMPTS = 3


@dataclass(frozen=True)
class Placement:
    """Where this process sits: its rank, the world size, its local rank (for the device)."""

    rank: int
    world: int
    local_rank: int

    @classmethod
    def from_environment(cls, rank: int | None, world: int | None, environ: dict[str, str]) -> Placement:
        """From the arguments, else a launcher's `RANK` / `WORLD_SIZE` / `LOCAL_RANK` (torchrun's)."""
        rank = rank if rank is not None else int(environ.get("RANK", "0"))
        world = world if world is not None else int(environ.get("WORLD_SIZE", "1"))
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"expected 0 <= rank < world size, got rank {rank} of {world}")
        return cls(rank, world, int(environ.get("LOCAL_RANK", str(rank))))


def select_device(placement: Placement) -> str:
    """Make this rank's accelerator (LOCAL_RANK) the current device, where the host has one; in words."""
    if not torch.accelerator.is_available():
        return "no accelerator"
    count = torch.accelerator.device_count()
    if placement.local_rank >= count:
        return f"local rank {placement.local_rank} has no device of its own ({count} on this host)"
    torch.accelerator.set_device_index(placement.local_rank)
    return f"device index {placement.local_rank}"


def choose_backend(declared: str, requested: str | None) -> tuple[str, str]:
    """`(backend, note)`: `requested`, else the vendor's declared backend; gloo where the declared one is
    not in this torch build (an emulated vendor: its tensors live on the host)."""
    if requested:
        return requested, f"--backend {requested}"
    if dist.is_backend_available(declared):
        return declared, ""
    return "gloo", f"the declared backend {declared} is not in this torch build; the ranks use gloo"


class World:
    """The default group, the control group and the current data group of one rank."""

    def __init__(self, placement: Placement, backend: str, init_method: str, timeout_s: float) -> None:
        self.placement = placement
        self.backend = backend
        self.timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend, init_method=init_method, rank=placement.rank, world_size=placement.world, timeout=self.timeout
        )
        # the control group outlasts any collective of a case it waits for
        self.control = dist.new_group(backend="gloo", timeout=2 * self.timeout + timedelta(seconds=60))
        self.data: Any = self._new_data()

    def _new_data(self) -> Any:
        """A data group made by every rank together: an attempt that failed on any rank is dropped on
        all of them and made again, so the ranks never hold groups out of step."""
        errors: list[Any] = [None] * self.placement.world
        for _ in range(DATA_GROUP_ATTEMPTS):
            group, error = None, None
            try:
                group = dist.new_group(backend=self.backend, timeout=self.timeout)
            except Exception as exc:  # noqa: BLE001 - told to every rank, which then all try again
                error = f"rank {self.placement.rank}: {type(exc).__name__}: {exc}"
            dist.all_gather_object(errors, error, group=self.control)
            if not any(errors):
                return group
            if group is not None:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)
        failed = "; ".join(e for e in errors if e)
        raise RuntimeError(f"the ranks could not make a data group in {DATA_GROUP_ATTEMPTS} attempts: {failed}")

    def drop_data(self) -> None:
        """Leave the data group now: destroyed, and the failed case's layers (which hold it, in reference
        cycles) collected, its connections close, so peers blocked in one of its collectives fail at once."""
        if self.data is not None:
            with contextlib.suppress(Exception):  # a broken group may refuse to be destroyed; it is dropped anyway
                dist.destroy_process_group(self.data)
            self.data = None
            gc.collect()

    def agree(self, outcome: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's outcome of the case just run, in rank order. A rank whose case did not pass (unless
        its declarations ruled the case out before any layer was made) leaves the data group first; if
        any rank left, every rank makes a fresh one."""
        dropped = outcome["outcome"] != "passed" and not outcome.get("declared", False)
        if dropped:
            self.drop_data()
        gathered: list[Any] = [None] * self.placement.world
        dist.all_gather_object(gathered, {**outcome, "dropped": dropped}, group=self.control)
        if any(o["dropped"] for o in gathered):
            self.drop_data()
            self.data = self._new_data()
        return gathered

    def close(self) -> None:
        """Leave every group."""
        if dist.is_initialized():
            dist.destroy_process_group()
