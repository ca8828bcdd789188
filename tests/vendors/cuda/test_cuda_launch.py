"""Triton launches through the compiled kernel's own launcher (`vendors/cuda/kernels/launch.py`): every
call after the first of a signature takes it, and a call whose arguments the JIT would specialise
differently (an address not 16-byte aligned, a size that is 1 or a multiple of 16, another dtype) gets
its own compiled kernel, so results equal the plain-torch definition whatever the order of calls
(GPU only)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _combine_case(tokens: int, hidden: int, dtype: torch.dtype, offset: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = 4
    storage = torch.randn(tokens * k * hidden + offset, device="cuda", generator=gen).to(dtype)
    rows = storage[offset:].view(tokens * k, hidden)  # offset 1: an address the JIT does not call aligned
    weights = torch.rand(tokens, k, device="cuda", generator=gen)
    index = torch.randperm(tokens * k, device="cuda", generator=gen)
    return rows, index, weights


@pytest.mark.parametrize("order", ["aligned first", "misaligned first"])
def test_launches_of_other_specialisations_compute_their_own_result(order):
    from hal.reference import weighted_combine as reference_combine
    from vendors.cuda.kernels import combine, launch

    cases = [
        (1, 256, torch.bfloat16, 0),
        (1, 255, torch.bfloat16, 1),
        (16, 256, torch.float32, 0),
        (3, 17, torch.float32, 1),
    ]
    if order == "misaligned first":
        cases.reverse()
    for repeat in range(3):  # the first call of each signature through the JIT, the rest directly
        for seed, (tokens, hidden, dtype, offset) in enumerate(cases):
            rows, index, weights = _combine_case(tokens, hidden, dtype, offset, seed)
            got = combine.weighted_combine(rows, index, weights, torch.float32)
            want = reference_combine(rows, index, weights, torch.float32)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (repeat, tokens, hidden, dtype, offset)
    kept = [key for key in launch._COMPILED if key[0] is combine._combine]
    assert len(kept) >= 3, "calls the JIT specialises differently shared one compiled kernel"


def test_a_launch_hook_takes_the_jit_path():
    triton = pytest.importorskip("triton")
    from vendors.cuda.kernels import combine, launch

    seen = []
    hooks = triton.knobs.runtime.launch_enter_hook
    if not hasattr(hooks, "add"):
        pytest.skip("this Triton has no hook chains")
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    rows, index, weights = _combine_case(2, 64, torch.float32, 0, 0)
    combine.weighted_combine(rows, index, weights, torch.float32)  # compiled and kept
    hooks.add(hook)
    try:
        combine.weighted_combine(rows, index, weights, torch.float32)
    finally:
        hooks.remove(hook)
    assert seen, "a profiler's launch hook was not called"
    assert launch._hooked(hooks) is False


def test_host_integer_helpers_equal_tritons():
    triton = pytest.importorskip("triton")
    from vendors.cuda.kernels.launch import cdiv, next_power_of_2

    for n in [*range(0, 300), 1023, 1024, 1025, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 16, 128, 129):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_a_remembered_integer_class_equals_the_one_computed_afresh():
    pytest.importorskip("triton")
    from vendors.cuda.kernels import launch

    values = [0, 1, 2, 15, 16, 17, 2**31 - 16, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63, -16]
    fresh = [launch._int_class(v) for v in values]
    first = launch._signature(tuple(values))
    assert launch._signature(tuple(values)) == first == tuple(fresh)
    assert len(set(fresh)) >= 5, "the classes no longer tell 1, multiples of 16, 32- and 64-bit values apart"
    assert launch._signature((True, 1.5, None)) == (bool, float, type(None))
    assert launch._signature((object(),)) is None
