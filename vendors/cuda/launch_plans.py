"""Launch plans: an eager forward's kernel launches recorded once per input signature and issued again from the host.

At decode an eager call of the layer spends most of its time on the host (the layer's Python, the hal's checks,
the ops' tile choices, argument binding), not in its four to six kernels. A launch plan keeps, for one signature of
inputs, what that host work decided: each Triton launch (the compiled kernel, its grid, its arguments) and each
allocation. A replay allocates the intermediates as one block, puts the pointers of the caller's tensors and of the
new block into the recorded arguments and calls each compiled kernel's launcher: the same kernels with the same
arguments, so the output equals the plain forward's bit for bit.

A forward is recorded only where all of its device work is seen by the recorder:
- each torch op it runs is an allocation or a view (a `TorchDispatchMode` watches); any other op (a copy, a torch
  GEMM, a host read) refuses the plan;
- each kernel goes through `kernels.launch.launch` to a compiled kernel whose launcher is called directly, on the
  stream the forward started on; a launch through Triton's JIT (TMA descriptors, a launch hook) or a library's own
  kernels (`refuse_recording`) refuses it;
- it returns a tensor it allocated.
A recorded plan is then replayed once on the same inputs, its intermediates filled with 0xFF bytes first, and used
only once its output is known to equal the recorded one bit for bit (compared on the device; the verdict is read
when it has arrived, so recording never synchronises with the host; calls before then run the plain forward). A
refused signature runs the plain forward from then on.

A replay first checks that the inputs have the recorded shapes, dtypes, strides, device and 16-byte alignment and
that the current stream is the recorded one (tensors a vendor keeps per stream, such as split-K scratch, are part of
the plan); otherwise it runs the plain forward.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hal import GraphSet, invalid

_LOG = logging.getLogger(__name__)
_ALIGN = 256  #: offset of each intermediate in a replay's block (the caching allocator's blocks are 512-aligned)
_ALLOCATING = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    }
)
_DIFFERED = "a replay differed from the recorded forward"
#: an issued launch: the recorded launcher with its grid, stream and options bound; takes the arguments
Issue = Callable[[Sequence[Any]], None]


class _Active(threading.local):
    recorder: LaunchRecorder | None = None


#: the recorder of the forward this thread is recording, if any (set only for the length of one recording)
ACTIVE = _Active()


def refuse_recording(reason: str) -> None:
    """Called by device work a recorder cannot see (a library's own kernels): the forward being recorded on
    this thread, if any, gets no plan."""
    recorder = ACTIVE.recorder
    if recorder is not None:
        recorder.refuse(reason)


@dataclass(frozen=True)
class _Step:
    issue: Issue
    args: tuple[Any, ...]  #: the recorded arguments, pointers of the caller's tensors and of intermediates as None
    pointers: tuple[tuple[int, int, int], ...]  #: (argument index, slot, byte offset from the slot's start)


class LaunchRecorder:
    """What one recorded forward launched and allocated (filled by `launch` and the dispatch mode)."""

    def __init__(self, inputs: Sequence[torch.Tensor], stream: Any) -> None:
        self.inputs = tuple(inputs)
        self.stream = stream
        self.allocations: list[torch.Tensor] = []  # kept alive, so no address is reused while recording
        self.steps: list[_Step] = []
        self.constants: list[torch.Tensor] = []  # tensors the plan reads by address (weights, scratch)
        self.refused: str | None = None

    def refuse(self, reason: str) -> None:
        """Mark the recording unusable (the first reason is kept)."""
        if self.refused is None:
            self.refused = reason

    def allocated(self, tensor: Any) -> None:
        """A tensor the forward allocated."""
        if isinstance(tensor, torch.Tensor):
            self.allocations.append(tensor)

    def launched(self, issue: Issue, args: Sequence[Any], stream: Any) -> None:
        """A launch of `issue(args)` on `stream`, as it will be issued again with the replay's pointers."""
        if stream != self.stream:
            self.refuse("a kernel launched on another stream than the forward's")
            return
        template = list(args)
        pointers = []
        for i, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor):
                continue
            where = self._locate(arg)
            if where is None:  # neither an input nor an intermediate: a tensor that outlives the call
                template[i] = arg.data_ptr()
                self.constants.append(arg)
            else:
                template[i] = None
                pointers.append((i, *where))
        self.steps.append(_Step(issue, tuple(template), tuple(pointers)))

    def _locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        ptr = t.data_ptr()
        storage = t.untyped_storage().data_ptr()
        if ptr == 0:
            return None
        for slot, given in enumerate(self.inputs):
            if given.untyped_storage().data_ptr() == storage:
                offset = ptr - given.data_ptr()
                if offset < 0 or offset > _span(given):
                    self.refuse("a kernel reads outside an input's own elements")
                return slot, offset
        for j, made in enumerate(self.allocations):
            if made.untyped_storage().data_ptr() == storage:
                return len(self.inputs) + j, ptr - storage
        return None


class _Watch(TorchDispatchMode):
    """Refuses the recording at any torch op that is neither an allocation nor a view."""

    def __init__(self, recorder: LaunchRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATING:
            self.recorder.allocated(out)
        elif not getattr(func, "is_view", False):
            self.recorder.refuse(f"the torch op {func} (device work outside a recorded launch)")
        return out


def _span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to past its last."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _meta(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What a replay must find again in an input; None for a tensor subclass (its memory is not its own to read)."""
    if type(t) is not torch.Tensor:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, not t.data_ptr() & 15)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> Callable[[], bool | None]:
    """Whether two tensors hold the same bits, as a verdict read later: on a CUDA device the comparison runs on
    the device and its flag is copied back without a synchronisation (None until it has arrived)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return lambda: False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if a.element_size() in ints:  # NaN payloads compare as bits
        kind = ints[a.element_size()]
        a, b = a.view(kind), b.view(kind)
    same = (a == b).all() if a.numel() else torch.ones((), dtype=torch.bool, device=a.device)
    if same.device.type != "cuda":
        return lambda: bool(same)
    flag = torch.empty((), dtype=torch.bool, pin_memory=True)
    flag.copy_(same, non_blocking=True)
    arrived = torch.cuda.Event()
    arrived.record()
    return lambda: bool(flag) if arrived.query() else None


class LaunchPlan:
    """One recorded forward (see the module); calling it replays the launches, or runs the forward where the
    inputs or the stream differ from the recording's."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        recorder: LaunchRecorder,
        output: torch.Tensor,
        current_stream: Callable[[], Any],
        ready: Callable[[], bool],
        capturing: Callable[[], bool] = lambda: False,
    ) -> None:
        self._fn = fn
        self._capturing = capturing
        #: the check replay's verdict, until it is read (calls run `fn` until then); then None
        self._pending: Callable[[], bool | None] | None = None
        self._refused: Callable[[], None] | None = None  #: set when the check failed: every call runs `fn`
        self.usable = True
        self._current_stream = current_stream
        self._ready = ready
        self._stream = recorder.stream
        self._meta = tuple(_meta(t) for t in recorder.inputs)
        self._device = output.device
        self._steps = tuple(recorder.steps)
        self._constants = tuple(recorder.constants)
        made = recorder.allocations
        out_slot = next(j for j, t in enumerate(made) if t.untyped_storage().data_ptr() == _storage(output))
        self._out = (made[out_slot].shape, made[out_slot].stride(), made[out_slot].dtype)
        same = output.shape == made[out_slot].shape and output.stride() == made[out_slot].stride()
        self._out_view = None if same else (output.shape, output.stride(), output.storage_offset())
        offsets, total = [], 0
        for j, t in enumerate(made):
            offsets.append(None if j == out_slot else total)
            if j != out_slot:
                total += -(-t.untyped_storage().nbytes() // _ALIGN) * _ALIGN
        self._offsets = tuple(offsets)
        self._total = total

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        # the verdict is not read inside a CUDA-graph capture (an event query there would break the capture)
        if self._pending is not None and (self._capturing() or not self._settle()):
            return self._fn(*inputs)
        if (
            not self.usable
            or len(inputs) != len(self._meta)
            or tuple(_meta(t) for t in inputs) != self._meta
            or self._current_stream() != self._stream
            or not self._ready()
        ):
            return self._fn(*inputs)
        return self.replay(inputs)

    def check(self, inputs: Sequence[torch.Tensor], recorded: torch.Tensor, on_refused: Callable[[], None]) -> None:
        """Replay once into poisoned memory and compare with the recorded output (read at a later call)."""
        self._pending = _same_bits(self.replay(inputs, poison=True), recorded)
        self._refused = on_refused
        self._settle()

    def _settle(self) -> bool:
        """Read the check's verdict if it has arrived; whether the plan may replay now."""
        verdict = self._pending() if self._pending is not None else True
        if verdict is None:
            return False
        if self._pending is not None:
            self._pending = None
            if not verdict:
                self.usable = False
                if self._refused is not None:
                    self._refused()
        return self.usable

    def replay(self, inputs: Sequence[torch.Tensor], poison: bool = False) -> torch.Tensor:
        """The launches again with `inputs` (checked by the caller); `poison` fills the new tensors with 0xFF
        bytes first (a check that every intermediate is written before it is read)."""
        shape, stride, dtype = self._out
        out = torch.empty_strided(shape, stride, dtype=dtype, device=self._device)
        bases = [t.data_ptr() for t in inputs]
        block, start = None, 0
        if self._total:
            block = torch.empty(self._total, dtype=torch.uint8, device=self._device)
            start = block.data_ptr()
        if poison:
            out.fill_(float("nan") if out.is_floating_point() else -1)
            if block is not None:
                block.fill_(255)
        out_ptr = out.data_ptr()
        for offset in self._offsets:
            bases.append(out_ptr if offset is None else start + offset)
        for step in self._steps:
            args = list(step.args)
            for i, slot, offset in step.pointers:
                args[i] = bases[slot] + offset
            step.issue(args)
        del block  # freed on the caller's stream, after the launches in its order
        if self._out_view is not None:
            return out.as_strided(*self._out_view)
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class LaunchPlanSet(GraphSet):
    """`hal.GraphSet` of launch plans on one device (`hal.Vendor.launch_plan_set`): captures record, calls replay.

    `current_stream()` gives the stream launches run on (compared as recorded); `ready()` says whether launches
    may bypass the launch path now (no profiler's hook set); `capturing()` whether the current stream is being
    captured into a CUDA graph (no recording then: its check replay reads the output back)."""

    def __init__(
        self,
        device: torch.device,
        current_stream: Callable[[], Any],
        ready: Callable[[], bool],
        capturing: Callable[[], bool] = lambda: False,
    ) -> None:
        self.device = device
        self._current_stream = current_stream
        self._ready = ready
        self._capturing = capturing
        self.refusals: dict[str, int] = {}  #: why forwards got no plan, counted (`MoELayer.launch_plan_refusals`)

    def can_capture(self) -> bool:
        """Whether a recording may be made now (launches direct, no graph capture under way)."""
        return self._ready() and not self._capturing()

    def capture(self, fn: Callable[..., torch.Tensor], example_inputs: Sequence[torch.Tensor]) -> Callable:
        """Record `fn(*example_inputs)` and return its plan, or `fn` itself where it cannot be replayed (see
        the module). The recording runs `fn` once and the check replays it once."""
        if not callable(fn):
            raise invalid("fn", "a callable", type(fn).__name__)
        inputs = tuple(example_inputs)
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise invalid(f"example_inputs[{i}]", "a tensor", type(t).__name__)
        filled = [t for t in inputs if t.numel()]
        if any(type(t) is not torch.Tensor for t in inputs):
            plan, reason = None, "an input is a tensor subclass"
        elif len({_storage(t) for t in filled}) < len(filled):
            plan, reason = None, "two inputs share memory"
        else:
            plan, reason = self._record(fn, inputs)
        if plan is None:
            self._count(reason)
            return fn
        return plan

    def _record(
        self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]
    ) -> tuple[LaunchPlan | None, str]:
        if not self.can_capture():
            return None, "a launch hook is set or a CUDA graph is being captured"
        if ACTIVE.recorder is not None:
            return None, "a recording is already under way on this thread"
        recorder = ACTIVE.recorder = LaunchRecorder(inputs, self._current_stream())
        try:  # an error here is the plain forward's to raise (the call runs it next), or the recording's to absorb
            with _Watch(recorder):
                output = fn(*inputs)
        except Exception as error:  # noqa: BLE001 (any error: the plain forward decides whether it is real)
            return None, f"the forward raised {type(error).__name__} while it was recorded"
        finally:
            ACTIVE.recorder = None
        if recorder.refused is not None:
            return None, recorder.refused
        if not isinstance(output, torch.Tensor) or all(_storage(t) != _storage(output) for t in recorder.allocations):
            return None, "the forward returns a tensor it did not allocate"
        if not recorder.steps:
            return None, "the forward launched no recorded kernel"
        if output.dtype != next(t.dtype for t in recorder.allocations if _storage(t) == _storage(output)):
            return None, "the forward returns a view of another dtype"
        plan = LaunchPlan(fn, recorder, output, self._current_stream, self._ready, self._capturing)
        try:
            plan.check(inputs, output, lambda: self._count(_DIFFERED))
        except Exception as error:  # noqa: BLE001 (as above: that signature runs the plain forward)
            return None, f"the check replay raised {type(error).__name__}"
        return plan, ""

    def _count(self, reason: str) -> None:
        if reason not in self.refusals:  # once per reason and set (a layer's)
            _LOG.info("launch plan not recorded: %s; that input signature runs the plain forward", reason)
        self.refusals[reason] = self.refusals.get(reason, 0) + 1


__all__ = ["ACTIVE", "LaunchPlan", "LaunchPlanSet", "LaunchRecorder", "refuse_recording"]
