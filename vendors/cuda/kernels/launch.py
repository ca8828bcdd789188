"""Triton launches without the JIT's per-call work, once a kernel is compiled.

`kernel[grid](*args, **meta)` binds the arguments, specialises them, builds a string key and looks the
compiled kernel up on every call: about 20 µs of host time per launch on the H100 hosts measured
(30 µs a launch through the JIT, 11 µs through the compiled kernel's own launcher; 41 µs with
`launch_pdl`). `launch(kernel, grid, *args, **meta)` does the JIT's launch the first time a call of
a given signature is seen and keeps the compiled kernel under a key of its own; later calls of that
signature go straight to the compiled kernel's C launcher (past `CompiledKernel.run`'s Python frame
where the Triton release is one whose layout was checked and the kernel needs no scratch memory).

The key holds everything the JIT specialises on, and more: each tensor's dtype and whether its
address is 16-byte aligned; each integer's value class (1, a multiple of 16, 32- or 64-bit); the
type of anything else; every keyword (constexprs and options) with its value; the current device.
Calls with other argument types (e.g. tensor descriptors) and calls while a launch hook is set (a
profiler) always take the JIT's path.

While this thread records a launch plan (`vendors.cuda.launch_plans`), each launch is also handed to the
recorder as the launcher call it made; a launch through the JIT's path refuses the recording.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton import knobs

# torch's own calls for the current device and its current stream (what Triton's CUDA driver calls too)
from vendors.cuda.kernels.current import current_device as _current_device
from vendors.cuda.kernels.current import current_stream as _current_stream
from vendors.cuda.launch_plans import ACTIVE as _RECORDING

# compiled kernels by (kernel, signature key): a cache like the JIT's own, filled at first use
_COMPILED: dict[tuple[Any, ...], tuple[Any, Any, tuple[Any, ...]]] = {}
# each host integer's value class (see `_int_class`), memoised: sizes and strides repeat from call to call
_INT_CLASSES: dict[int, int] = {}
_INT_CLASSES_MAX = 4096
_TENSOR = torch.Tensor
_I32 = range(-(2**31), 2**31)
# The Triton releases whose compiled-kernel launcher (`CompiledKernel.run`) takes the layout `_direct` relies on;
# with another release every launch goes through `run` itself.
_DIRECT_TRITON = ("3.6.",)


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` of host integers (`triton.cdiv` unwraps constexprs on every call: microseconds)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= `n` of a host integer (0 for 0, as `triton.next_power_of_2`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _int_class(a: int) -> int:
    """What the JIT specialises an integer on: 1, divisible by 16, and whether it fits 32 or 64 bits."""
    return 1 if a == 1 else (2 if a & 15 == 0 else 3) + (0 if a in _I32 else 4 + (a >= 2**63))


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    key: list[Any] = []
    append = key.append
    classes = _INT_CLASSES
    for a in args:
        kind = type(a)
        if kind is int:
            found = classes.get(a)
            if found is None:
                if len(classes) >= _INT_CLASSES_MAX:
                    classes.clear()
                found = classes[a] = _int_class(a)
            append(found)
        elif kind is _TENSOR or isinstance(a, _TENSOR):
            append(a.dtype)
            append(not a.data_ptr() & 15)
        elif kind is bool or kind is float or a is None:
            append(kind)
        else:
            return None
    return tuple(key)


def _hooked(hook: Any) -> bool:
    # a chain of hooks (Triton 3.5+) is set when it holds any; earlier, a hook was a callable or None
    return bool(getattr(hook, "calls", True)) if hook is not None else False


def _direct(compiled: Any) -> Any:
    """The C launcher under `compiled.run`, where calling it directly is known to be the same launch (no
    scratch memory to allocate; a Triton release of the layout `_DIRECT_TRITON` names), else None."""
    run = getattr(compiled, "run", None)
    needed = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size")
    if not triton.__version__.startswith(_DIRECT_TRITON) or not all(hasattr(run, name) for name in needed):
        return None
    if run.global_scratch_size or run.profile_scratch_size:
        return None
    return run.launch


def direct_launches() -> bool:
    """Whether launches go to compiled kernels' launchers now (not interpreted, no launch hook set)."""
    runtime = knobs.runtime
    return not (runtime.interpret or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """`kernel[grid](*args, **meta)`, through the compiled kernel's launcher when this signature was seen
    (see the module); positional `args` then keyword constexprs and options, as the JIT takes them."""
    runtime = knobs.runtime
    recorder = _RECORDING.recorder
    signature = None if runtime.interpret else _signature(args)
    if signature is None or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
        kernel[grid](*args, **meta)
        if recorder is not None:
            recorder.refuse(f"a launch of {getattr(kernel, '__name__', kernel)} through Triton's JIT")
        return
    device = _current_device()
    key = (kernel, device, signature, tuple(meta.items()))
    found = _COMPILED.get(key)
    if found is None:
        compiled = kernel[grid](*args, **meta)
        if not hasattr(compiled, "packed_metadata"):  # not a compiled kernel (an interpreter's, a future Triton)
            if recorder is not None:
                recorder.refuse("a launch without a compiled kernel")
            return
        params = kernel.params[len(args) :]
        tail = tuple(meta.get(p.name, p.default) for p in params)
        _COMPILED[key] = (compiled, _direct(compiled), tail)
        if recorder is not None:
            _record(recorder, _COMPILED[key], grid, _current_stream(device), args)
        return
    compiled, direct, tail = found
    stream = _current_stream(device)
    x, y, z = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
    if recorder is not None:
        _record(recorder, found, grid, stream, args)
    if direct is not None:  # what `compiled.run` does when there is no scratch memory, without its frame
        run = compiled.run
        direct(
            x,
            y,
            z,
            stream,
            compiled.function,
            run.launch_cooperative_grid,
            run.launch_pdl,
            None,
            None,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
            *tail,
        )
        return
    compiled.run(x, y, z, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)


def _record(
    recorder: Any, found: tuple[Any, Any, tuple[Any, ...]], grid: tuple[int, ...], stream: int, args: Any
) -> None:
    """Hand a launch to the recorder as the direct launcher call that issues it again."""
    compiled, direct, tail = found
    if direct is None:
        recorder.refuse("a compiled kernel whose launcher is not called directly (scratch memory, another Triton)")
        return
    run = compiled.run
    x, y, z = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
    head = (x, y, z, stream, compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None)
    head += (compiled.packed_metadata, None, None, None)

    def issue(given: Any) -> None:
        direct(*head, *given, *tail)

    recorder.launched(issue, args, stream)
