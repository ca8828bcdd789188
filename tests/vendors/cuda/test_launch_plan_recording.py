"""Launch plans' recording and replay, on the CPU: the kernels here read and write memory through the raw
addresses they are handed (as a compiled kernel does), so a replay that gets a pointer wrong computes a wrong
result. The CUDA layer's plans against its plain forward: tests/vendors/cuda/test_cuda_launch_plans.py."""

from __future__ import annotations

import ctypes

import pytest
import torch

from vendors.cuda.launch_plans import ACTIVE, LaunchPlan, LaunchPlanSet, refuse_recording


def _floats(ptr: int, n: int) -> ctypes.Array:
    return (ctypes.c_float * n).from_address(ptr)


def _ptr(a: object) -> int:
    return a if isinstance(a, int) else a.data_ptr()  # type: ignore[union-attr]


def _axpy(args: list) -> None:
    """out[i] = alpha * x[i * stride] + y[i] for i < n: args (x, y, out, n, stride, alpha)."""
    x, y, out = (_floats(_ptr(a), 1 << 16) for a in args[:3])
    n, stride, alpha = args[3:]
    for i in range(n):
        out[i] = alpha * x[i * stride] + y[i]


def launch(kernel, *args: object) -> None:
    """Run `kernel(args)` now and hand it to the thread's recorder, as `kernels.launch.launch` does."""
    kernel(list(args))
    recorder = ACTIVE.recorder
    if recorder is not None:
        recorder.launched(lambda given: kernel(list(given)), args, None)


WEIGHT = torch.linspace(-1.0, 1.0, 64)


def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Two launches through an intermediate (the second half of one allocation) and a tensor that outlives the
    call: (2 x + y) * 0.5 + weight."""
    n = y.shape[0]
    tmp = torch.empty(2 * n, dtype=torch.float32)[n:]
    launch(_axpy, x, y, tmp, n, x.stride(0), 2.0)
    out = torch.empty(n, dtype=torch.float32)
    launch(_axpy, tmp, WEIGHT[:n], out, n, 1, 0.5)
    return out


def returns_a_view(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y in the second half of an allocation, returned as that view."""
    n = y.shape[0]
    out = torch.empty(2 * n, dtype=torch.float32)[n:]
    launch(_axpy, x, y, out, n, x.stride(0), 1.0)
    return out


def _plans() -> LaunchPlanSet:
    return LaunchPlanSet(torch.device("cpu"), lambda: None, lambda: True)


def test_a_plan_replays_with_new_inputs_and_equals_the_forward():
    x, y = torch.randn(64), torch.randn(64)
    plan = _plans().capture(forward, (x, y))
    assert isinstance(plan, LaunchPlan)
    for _ in range(3):
        a, b = torch.randn(64), torch.randn(64)
        got = plan(a, b)
        assert torch.equal(got, forward(a, b))
        assert torch.allclose(got.double(), (2 * a.double() + b.double()) * 0.5 + WEIGHT.double(), atol=1e-6)


def test_an_empty_intermediate_is_harmless():
    def with_empty(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        unused = torch.empty(0, dtype=torch.float32)
        out = torch.empty(y.shape[0], dtype=torch.float32)
        launch(_axpy, x, y, out, y.shape[0], 1, 3.0)
        launch(_axpy, unused, out, out, 0, 1, 1.0)  # a kernel given an empty tensor (it reads none of it)
        return out

    plan = _plans().capture(with_empty, (torch.randn(64), torch.randn(64)))
    assert isinstance(plan, LaunchPlan) and plan.usable
    x, y = torch.randn(64), torch.randn(64)
    assert torch.equal(plan(x, y), with_empty(x, y))
    assert torch.allclose(plan(x, y), 3 * x + y)


def test_a_returned_view_of_an_allocation_is_rebuilt():
    plan = _plans().capture(returns_a_view, (torch.randn(64), torch.randn(64)))
    assert isinstance(plan, LaunchPlan)
    x, y = torch.randn(64), torch.randn(64)
    got = plan(x, y)
    assert got.shape == (64,) and got.storage_offset() == 64
    assert torch.equal(got, x + y)


def test_inputs_read_through_a_view_keep_their_offset():
    def shifted(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return forward(x[4:], y)  # a kernel reads the input from its fifth element on

    plan = _plans().capture(shifted, (torch.randn(132)[2:][::2], torch.randn(62)))
    assert isinstance(plan, LaunchPlan)
    other = torch.randn(132)[2:][::2]  # an input that does not start its storage
    y = torch.randn(62)
    assert torch.equal(plan(other, y), forward(other[4:], y))


def test_inputs_of_other_strides_or_alignment_run_the_plain_forward():
    calls = []

    def counted(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return forward(x, y)

    plan = _plans().capture(counted, (torch.randn(64), torch.randn(64)))
    recorded = len(calls)
    strided = torch.randn(128)[::2]
    misaligned = torch.randn(65)[1:]
    y = torch.randn(64)
    assert torch.equal(plan(strided, y), forward(strided, y))
    assert torch.equal(plan(misaligned, y), forward(misaligned, y))
    assert len(calls) == recorded + 2
    plan(torch.randn(64), y)
    assert len(calls) == recorded + 2  # a matching call replays


def test_a_call_on_another_stream_runs_the_plain_forward():
    stream = ["a"]
    plans = LaunchPlanSet(torch.device("cpu"), lambda: stream[0], lambda: True)
    calls = []

    def on_stream(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        n = y.shape[0]
        out = torch.empty(n)
        kernel = _axpy
        kernel([x, y, out, n, 1, 1.0])
        ACTIVE.recorder and ACTIVE.recorder.launched(lambda g: kernel(list(g)), (x, y, out, n, 1, 1.0), stream[0])
        return out

    plan = plans.capture(on_stream, (torch.randn(64), torch.randn(64)))
    assert isinstance(plan, LaunchPlan)
    before = len(calls)
    stream[0] = "b"
    x, y = torch.randn(64), torch.randn(64)
    assert torch.equal(plan(x, y), x + y)
    assert len(calls) == before + 1


def test_torch_compute_in_the_forward_refuses_the_plan(caplog):
    plans = _plans()
    caplog.set_level("INFO", logger="vendors.cuda.launch_plans")

    def with_torch_op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return forward(x * 1.0, y)  # the multiply is device work no launch records

    fn = plans.capture(with_torch_op, (torch.randn(64), torch.randn(64)))
    assert fn is with_torch_op
    assert any("aten.mul" in reason for reason in plans.refusals)
    plans.capture(with_torch_op, (torch.randn(64), torch.randn(64)))
    logged = [r.getMessage() for r in caplog.records if "launch plan not recorded" in r.getMessage()]
    assert len(logged) == 1 and "aten.mul" in logged[0]  # once per reason


def test_an_intermediate_written_outside_a_launch_refuses_the_plan():
    """The unrecorded write is caught by the check replay: its intermediates start as 0xFF bytes."""
    plans = _plans()

    def hidden_write(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = y.shape[0]
        tmp = torch.empty(n)
        ctypes.memmove(tmp.data_ptr(), y.data_ptr(), 4 * n)  # device work the recorder cannot see
        out = torch.empty(n)
        launch(_axpy, x, tmp, out, n, 1, 1.0)
        return out

    plan = plans.capture(hidden_write, (torch.randn(64), torch.randn(64)))
    assert isinstance(plan, LaunchPlan) and not plan.usable
    assert plans.refusals == {"a replay differed from the recorded forward": 1}
    x, y = torch.randn(64), torch.randn(64)
    assert torch.equal(plan(x, y), x + y)  # the plain forward


def test_a_library_kernel_in_the_forward_refuses_the_plan():
    plans = _plans()

    def with_library(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        refuse_recording("a library's own kernels")  # what the DeepGEMM and quack runners say
        return forward(x, y)

    assert plans.capture(with_library, (torch.randn(64), torch.randn(64))) is with_library
    assert plans.refusals == {"a library's own kernels": 1}
    refuse_recording("outside a recording: nothing happens")


def test_a_forward_returning_an_input_or_launching_nothing_gets_no_plan():
    plans = _plans()
    assert plans.capture(lambda x, y: x, (torch.randn(4), torch.randn(4))) is not None
    assert "the forward returns a tensor it did not allocate" in plans.refusals
    plans.capture(lambda x, y: torch.empty(4), (torch.randn(4), torch.randn(4)))
    assert "the forward launched no recorded kernel" in plans.refusals


def test_inputs_sharing_memory_get_no_plan():
    plans = _plans()
    both = torch.randn(128)
    fn = plans.capture(forward, (both[:64], both[64:]))
    assert fn is forward
    assert "two inputs share memory" in plans.refusals


class _Marked(torch.Tensor):
    """A tensor subclass (as a framework's wrapper tensors are)."""


def test_tensor_subclasses_are_neither_recorded_nor_replayed():
    plans = _plans()
    marked = torch.randn(64).as_subclass(_Marked)
    assert plans.capture(forward, (marked, torch.randn(64))) is forward
    assert "an input is a tensor subclass" in plans.refusals
    plan = plans.capture(forward, (torch.randn(64), torch.randn(64)))
    y = torch.randn(64)
    assert torch.equal(plan(marked, y), forward(torch.Tensor(marked), y))


def test_an_error_while_recording_leaves_the_plain_forward_to_raise_it():
    plans = _plans()
    calls = []

    def fails_once_recorded(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if ACTIVE.recorder is not None:
            raise RuntimeError("an op that does not run under the recorder")
        return forward(x, y)

    fn = plans.capture(fails_once_recorded, (torch.randn(64), torch.randn(64)))
    assert fn is fails_once_recorded and ACTIVE.recorder is None
    assert plans.refusals == {"the forward raised RuntimeError while it was recorded": 1}
    x, y = torch.randn(64), torch.randn(64)
    assert torch.equal(fn(x, y), forward(x, y))


def test_a_set_not_ready_records_nothing():
    plans = LaunchPlanSet(torch.device("cpu"), lambda: None, lambda: False)
    assert plans.capture(forward, (torch.randn(64), torch.randn(64))) is forward


def test_a_plan_falls_back_when_launches_stop_being_direct():
    ready = [True]
    plans = LaunchPlanSet(torch.device("cpu"), lambda: None, lambda: ready[0])
    plan = plans.capture(forward, (torch.randn(64), torch.randn(64)))
    assert isinstance(plan, LaunchPlan)
    ready[0] = False  # a profiler's launch hook was set: the plain forward goes through it
    x, y = torch.randn(64), torch.randn(64)
    assert torch.equal(plan(x, y), forward(x, y))


def test_the_check_s_verdict_is_not_read_inside_a_graph_capture():
    capturing = [False]
    plans = LaunchPlanSet(torch.device("cpu"), lambda: None, lambda: True, lambda: capturing[0])
    plan = plans.capture(forward, (torch.randn(64), torch.randn(64)))
    assert isinstance(plan, LaunchPlan)
    reads = []
    plan._pending = lambda: reads.append(1) or True  # a verdict still to be read (on a GPU: until it arrives)
    capturing[0] = True
    x, y = torch.randn(64), torch.randn(64)
    assert torch.equal(plan(x, y), forward(x, y)) and not reads
    capturing[0] = False
    assert torch.equal(plan(x, y), forward(x, y)) and reads == [1]
    assert plan._pending is None and plan.usable


def test_capture_rejects_what_is_not_a_function_or_tensors():
    from hal import InvalidInput

    with pytest.raises(InvalidInput):
        _plans().capture("forward", (torch.randn(4),))  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        _plans().capture(forward, (torch.randn(4), 3))  # type: ignore[arg-type]
