"""A layer called from several threads gives every thread the single-threaded result bit for bit, and
layers built concurrently each get the plan a serial build gives."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import moe
from hal import DispatchConfig

THREADS, CALLS = 8, 20
E, H, I, K = 8, 64, 32, 2


def in_threads(work: Callable[[int], Any], threads: int = THREADS) -> list[Any]:
    """`work(i)` for i in range(threads), each in its own thread, started together; their results in order."""
    start = threading.Barrier(threads)
    results: list[Any] = [None] * threads
    errors: list[BaseException] = []

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = work(i)
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    return results


def float_weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(15)
    return torch.randn(E, H, 2 * I, generator=gen) / 8, torch.randn(E, I, H, generator=gen) / 8


LAYERS = {
    # low latency: one dispatcher, its buffers per call (they were shared: 93 of 160 calls went wrong)
    "low-latency w8a8-int8": dict(scheme="w8a8-int8", dispatch=DispatchConfig(max_dispatch_tokens_per_rank=16)),
    "low-latency bf16": dict(dispatch=DispatchConfig(max_dispatch_tokens_per_rank=16)),
    "local fp32 with gated shared experts": dict(scheme="fp32", shared_experts=moe.SharedExperts(I, gated=True)),
}


@pytest.mark.parametrize("build", LAYERS)
def test_one_layer_called_from_eight_threads_gives_each_the_single_threaded_result(build, cpu):
    w13, w2 = float_weights()
    layer = moe.MoELayer.from_float(w13, w2, K, vendor=cpu, environ={}, **LAYERS[build])
    if layer.shared_experts is not None:
        gen = torch.Generator().manual_seed(1)
        layer.load_shared_experts(
            torch.randn(H, 2 * I, generator=gen) / 8,
            torch.randn(I, H, generator=gen) / 8,
            torch.randn(H, generator=gen),
        )
    gen = torch.Generator().manual_seed(2)
    # every thread its own token count, so that rows written by one call would land in another's result
    inputs = [
        (torch.randn(1 + (3 * i) % 16, H, generator=gen), torch.randn(1 + (3 * i) % 16, E, generator=gen))
        for i in range(THREADS)
    ]
    with torch.no_grad():
        expected = [layer(x, logits) for x, logits in inputs]

        def calls(i: int) -> list[torch.Tensor]:
            x, logits = inputs[i]
            return [layer(x, logits) for _ in range(CALLS)]

        got = in_threads(calls)
    wrong = [(i, n) for i in range(THREADS) for n, out in enumerate(got[i]) if not torch.equal(out, expected[i])]
    assert not wrong, f"{len(wrong)} of {THREADS * CALLS} calls differ from the single-threaded result"


SPECS: list[dict[str, Any]] = [
    dict(scheme="unquantized"),
    dict(scheme="w8a8-int8"),
    dict(scheme="fp16", environ={"HAL_DISPATCH_DTYPE": "fp32"}),
    dict(scheme="w8a8-fp8-block", environ={"HAL_DISPATCH_DTYPE": "bf16"}),
    dict(scheme="w8a8-int8", environ={"HAL_VENDOR": "ascend-emulated"}),
    dict(scheme="fp32", dispatch=DispatchConfig(max_dispatch_tokens_per_rank=8)),
    dict(scheme="w8a8-fp8", dispatch=DispatchConfig(dtype="int8")),
    dict(scheme="bf16", environ={"SGLANG_DEEPEP_BF16_DISPATCH": "1"}),
]


def build(spec: dict[str, Any]) -> moe.MoELayer:
    spec = {"environ": {}, **spec}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy variable's deprecation warning
        return moe.MoELayer(256, 128, E, K, **spec)


def test_layers_built_concurrently_each_get_the_plan_a_serial_build_gives():
    serial = [build(spec) for spec in SPECS]
    assert len({(layer.vendor.name, layer.plan.resolved, layer.plan.source) for layer in serial}) >= 6
    for _ in range(3):
        concurrent = in_threads(lambda i: build(SPECS[i]), threads=len(SPECS))
        for spec, alone, together in zip(SPECS, serial, concurrent):
            assert together.vendor.name == alone.vendor.name, spec
            assert together.plan == alone.plan, spec
            assert repr(together.dispatcher) == repr(alone.dispatcher), spec
        handles = [layer._handle for layer in concurrent]
        assert len(set(handles)) == len(handles)  # the custom op's registry gave each its own handle
