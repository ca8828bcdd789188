"""Real-model features on the CUDA vendor (skipped without a GPU): activations, biases, shared
experts and precomputed routing against float64, no host synchronisation, CUDA-graph replay,
and `torch.compile(fullgraph=True)` equal to eager (its time printed for the notes)."""

from __future__ import annotations

import warnings

import pytest
import torch

import moe
from conformance.reference import moe_features, relative_error, seed_of, softmax_topk
from conformance.tolerances import layer_tolerance
from tests.support.cuda_graph import capture
from vendors.cuda import CudaVendor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, H, I, S, K = 32, 1000, 352, 512, 4


def _layer(scheme, activation="silu-glu", bias=False, shared=False, seed=0):
    g = torch.Generator().manual_seed(seed_of("cuda-features", scheme, activation, bias, shared, seed))
    width = 2 * I if activation.endswith(("glu", "oai")) else I
    w13 = torch.randn(E, H, width, generator=g) / H**0.5
    w2 = torch.randn(E, I, H, generator=g) / I**0.5
    b13 = torch.randn(E, width, generator=g) * 0.3 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.3 if bias else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = moe.MoELayer.from_float(
            w13,
            w2,
            K,
            w13_bias=b13,
            w2_bias=b2,
            scheme=scheme,
            vendor=CudaVendor(),
            activation=activation,
            shared_experts=moe.SharedExperts(S, gated=True) if shared else None,
        )
    parts = None
    if shared:
        parts = (
            torch.randn(H, 2 * S if width == 2 * I else S, generator=g) / H**0.5,
            torch.randn(S, H, generator=g) / S**0.5,
            torch.randn(H, generator=g) / H**0.5,
        )
        layer.load_shared_experts(*parts)
    return layer, (w13, w2, b13, b2, parts)


def _inputs(tokens, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g).to(dtype), torch.randn(tokens, E, generator=g)


CASES = [
    ("unquantized", "silu-glu", True, True),
    ("unquantized", "swiglu-oai", True, False),
    ("unquantized", "gelu-tanh-glu", False, True),
    ("unquantized", "gelu", False, False),
    ("w8a8-fp8-block", "silu-glu", False, True),
    ("w8a8-fp8-block", "swiglu-oai", True, False),
]


@pytest.mark.parametrize("scheme, activation, bias, shared", CASES)
def test_features_on_the_gpu_match_float64(scheme, activation, bias, shared):
    layer, (w13, w2, b13, b2, parts) = _layer(scheme, activation, bias, shared)
    x, logits = _inputs(700, 1)
    y = layer(x.cuda(), logits.cuda())
    ids, weights = softmax_topk(logits, K)
    ref = moe_features(x, ids, weights, w13, w2, kind=activation, b13=b13, b2=b2, shared=parts)
    bound = layer_tolerance(scheme, "bf16" if scheme == "unquantized" else "fp8")
    assert relative_error(y.cpu(), ref) <= bound
    again = layer(x.cuda(), topk_ids=ids.cuda(), topk_weights=weights.cuda())
    assert relative_error(again.cpu(), ref) <= bound


@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-fp8-block"])
def test_features_never_synchronise_and_replay_in_a_graph(scheme):
    layer, _ = _layer(scheme, "swiglu-oai", True, True)
    x, logits = (t.cuda() for t in _inputs(64, 2))
    layer(x, logits)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_x, static_logits = x.clone(), logits.clone()
    graph, static_y = capture(lambda: layer(static_x, static_logits), warmup=1)
    for seed in (3, 4):
        nx, nl = (t.cuda() for t in _inputs(64, seed))
        static_x.copy_(nx)
        static_logits.copy_(nl)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, layer(nx, nl))


def _median_ms(fn, reps=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-fp8-block"])
def test_compiled_equals_eager_and_reports_its_time(scheme):
    torch._dynamo.reset()
    layer, _ = _layer(scheme, "silu-glu", False, True)
    compiled = torch.compile(layer, fullgraph=True)
    for tokens in (1, 64, 4096):
        x, logits = (t.cuda() for t in _inputs(tokens, tokens))
        got, want = compiled(x, logits), layer(x, logits)
        assert torch.equal(got, want), tokens
        eager_ms, compiled_ms = _median_ms(lambda: layer(x, logits)), _median_ms(lambda: compiled(x, logits))
        print(f"\nCOMPILE {scheme} tokens={tokens}: eager {eager_ms * 1e3:.1f} us, compiled {compiled_ms * 1e3:.1f} us")
