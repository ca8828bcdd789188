"""A layer built with `moe.GraphConfig` on the CUDA vendor replays real CUDA graphs: bit for bit the plain
forward, at realistic shapes, after new weights, with shared experts on a second stream, and from threads
on streams of their own (GPU only)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import moe
from conformance.reference import random_weights, seed_of
from tests.support.paths import release_device_memory
from vendors.cuda import CudaVendor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, H, I, K = 128, 2048, 768, 8  # qwen3-30b-a3b's layer
SCHEMES = ["unquantized", "w8a8-fp8-block"]


def _pair(scheme: str, seed: str = "a", **kwargs) -> tuple[moe.MoELayer, moe.MoELayer]:
    release_device_memory()
    w13, w2 = random_weights(E, H, I, seed_of("layer-graphs", scheme, seed))
    vendor = CudaVendor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphed = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=vendor, graphs=moe.GraphConfig(), **kwargs)
        plain = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=vendor, **kwargs)
    return graphed, plain


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, device="cuda", generator=g).to(torch.bfloat16)
    return x, torch.randn(tokens, E, device="cuda", generator=g)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_replays_equal_the_plain_forward_bit_for_bit(scheme):
    graphed, plain = _pair(scheme)
    for tokens in (1, 8, 64, 300, 1, 64):
        x, logits = _inputs(tokens, tokens)
        assert torch.equal(graphed(x, logits), plain(x, logits)), tokens
        x2, logits2 = _inputs(tokens, 1000 + tokens)  # the capture reads the new inputs, not the first ones
        assert torch.equal(graphed(x2, logits2), plain(x2, logits2)), tokens
    assert graphed.graph_count == 4


def test_new_weights_are_read_by_the_next_replay():
    graphed, _ = _pair("unquantized")
    x, logits = _inputs(16, 3)
    graphed(x, logits)
    w13, w2 = random_weights(E, H, I, seed_of("layer-graphs", "new"))
    graphed.load_weights(w13, w2)
    fresh = moe.MoELayer.from_float(w13, w2, K, vendor=graphed.vendor)
    assert torch.equal(graphed(x, logits), fresh(x, logits))
    assert torch.equal(graphed(x, logits), fresh(x, logits))


def test_shared_experts_on_the_side_stream_are_captured():
    shared = moe.SharedExperts(intermediate_size=512)
    graphed, plain = _pair("unquantized", shared_experts=shared)
    g = torch.Generator(device="cuda").manual_seed(5)
    ws = (torch.randn(H, 1024, device="cuda", generator=g) / H**0.5, torch.randn(512, H, device="cuda", generator=g))
    for layer in (graphed, plain):
        layer.load_shared_experts(ws[0], ws[1] / 512**0.5)
    for tokens in (2, 33, 2):
        x, logits = _inputs(tokens, 40 + tokens)
        assert torch.equal(graphed(x, logits), plain(x, logits))


def test_threads_on_their_own_streams_get_their_own_results():
    graphed, plain = _pair("unquantized")
    cases = [_inputs(t, 60 + t) for t in (1, 4, 1, 4, 32, 32)]
    expected = [plain(x, lg) for x, lg in cases]
    torch.cuda.synchronize()
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(5):
                results[i] = graphed(*cases[i])
            torch.cuda.current_stream().synchronize()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(results[i], expected[i]) for i in range(len(cases)))
