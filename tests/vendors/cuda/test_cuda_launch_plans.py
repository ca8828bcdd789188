"""An eager CUDA layer replays its recorded kernel launches (`moe.LaunchPlans`, the default) and computes what its
plain forward computes, bit for bit, without a host synchronisation (GPU only)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import moe
from conformance.reference import random_weights, seed_of
from hal import InvalidInput
from vendors.cuda import CudaVendor
from vendors.cuda.launch_plans import LaunchPlan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (experts, hidden, intermediate, top-k): qwen3-30b-a3b's layer, and one of sizes that are not multiples of 128
SHAPES = {"qwen3": (128, 2048, 768, 8), "odd": (40, 1000, 360, 6)}
SCHEMES = ["unquantized", "w8a8-fp8-block", "w8a8-int8"]
#: schemes whose decode path is Triton launches only (int8 on sm90 re-quantizes its fp8-carried rows in Triton; larger
#: batches may take torch's grouped GEMMs): these must get a plan
LAUNCH_ONLY = {"unquantized", "w8a8-fp8-block", "w8a8-int8"}


def _layers(shape: str, scheme: str) -> tuple[moe.MoELayer, moe.MoELayer]:
    e, h, i, k = SHAPES[shape]
    w13, w2 = random_weights(e, h, i, seed_of("plans", shape, scheme))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the declared int8 -> fp8 fallback warns once
        planned = moe.MoELayer.from_float(w13, w2, k, scheme=scheme, vendor=CudaVendor())
        plain = moe.MoELayer.from_float(w13, w2, k, scheme=scheme, vendor=CudaVendor(), launch_plans=None)
    return planned, plain


def _inputs(shape: str, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    e, h, _, _ = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, h, device="cuda", generator=g).to(torch.bfloat16), torch.randn(
        tokens, e, device="cuda", generator=g
    )


def _plans(layer: moe.MoELayer) -> list:
    return list(layer._graphs._graphs.values()) if layer._graphs is not None else []


@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_replayed_launches_equal_the_plain_forward(shape, scheme, tokens):
    planned, plain = _layers(shape, scheme)
    with torch.no_grad():
        for seed in range(6):
            x, logits = _inputs(shape, tokens, seed)
            assert torch.equal(planned(x, logits), plain(x, logits)), f"call {seed}"
    assert planned.launch_plan_count == 1 and plain.launch_plan_count == 0
    (plan,) = _plans(planned)
    refusals = planned.launch_plan_refusals
    if scheme in LAUNCH_ONLY and tokens <= 64:
        assert isinstance(plan, LaunchPlan) and plan.usable, refusals
    elif not (isinstance(plan, LaunchPlan) and plan.usable):  # refused: a torch op, or a TMA-fed GEMM's JIT launch
        assert all("torch op" in reason or "_grouped_gemm_tma" in reason for reason in refusals), refusals


def test_precomputed_routing_is_planned_apart_and_equal():
    planned, plain = _layers("odd", "unquantized")
    e, _, _, k = SHAPES["odd"]
    with torch.no_grad():
        for seed in range(4):
            x, logits = _inputs("odd", 16, seed)
            ids = torch.topk(logits, k, dim=-1).indices.to(torch.int32)
            weights = torch.softmax(logits, -1).gather(1, ids.long())
            assert torch.equal(
                planned(x, topk_ids=ids, topk_weights=weights), plain(x, topk_ids=ids, topk_weights=weights)
            )
            assert torch.equal(planned(x, logits), plain(x, logits))
    assert planned.launch_plan_count == 2


def test_recording_and_replaying_never_synchronise_with_the_host():
    planned, _ = _layers("odd", "w8a8-fp8-block")
    x, logits = _inputs("odd", 8, 1)
    planned(x, logits)  # compile the kernels first (compilation may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):  # the second call records, later ones read the check's verdict and replay
            planned(x, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    planned(x, logits)
    assert _plans(planned)[0].usable


def test_calls_from_another_stream_or_inside_a_graph_capture_equal_the_plain_forward():
    planned, plain = _layers("odd", "unquantized")
    x, logits = _inputs("odd", 4, 2)
    with torch.no_grad():
        for _ in range(3):
            planned(x, logits)
        expected = plain(x, logits)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = planned(x, logits)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(got, expected)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = planned(x, logits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)


def test_new_weights_drop_the_plans_and_the_next_ones_read_them():
    planned, plain = _layers("odd", "unquantized")
    x, logits = _inputs("odd", 8, 3)
    with torch.no_grad():
        for _ in range(3):
            planned(x, logits)
        e, h, i, _ = SHAPES["odd"]
        w13, w2 = random_weights(e, h, i, seed_of("plans", "new weights"))
        planned.load_weights(w13, w2)
        plain.load_weights(w13, w2)
        assert planned.launch_plan_count == 0
        for _ in range(3):
            assert torch.equal(planned(x, logits), plain(x, logits))
    assert planned.launch_plan_count == 1


def test_threads_replaying_one_plan_each_get_their_own_result():
    planned, plain = _layers("odd", "unquantized")
    inputs = [_inputs("odd", 8, 10 + t) for t in range(4)]
    with torch.no_grad():
        for _ in range(3):
            planned(*inputs[0])
        torch.cuda.synchronize()
        results: dict[int, torch.Tensor] = {}

        def work(t: int) -> None:
            with torch.no_grad():
                for _ in range(20):
                    results[t] = planned(*inputs[t])

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for t in range(4):
            assert torch.equal(results[t], plain(*inputs[t]))


def test_bad_input_to_a_planned_layer_is_refused_as_before():
    planned, _ = _layers("odd", "unquantized")
    x, logits = _inputs("odd", 8, 4)
    with torch.no_grad():
        for _ in range(3):
            planned(x, logits)
        with pytest.raises(InvalidInput):
            planned(x[:, :-1], logits)
        with pytest.raises(InvalidInput):
            planned(x, logits[:, :-1])


def test_one_byte_rows_gathered_before_the_gemm_do_not_refuse_the_plan():
    # 8 experts, top-2, 256 tokens: 64 one-byte rows per expert, which the first projection gathers before its GEMM
    # (the built-in rule reads them through the index only up to 32 per expert)
    e, h, i, k = 8, 1000, 360, 2
    scheme = "w8a8-fp8-block"
    w13, w2 = random_weights(e, h, i, seed_of("plans-gathered", scheme))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned = moe.MoELayer.from_float(w13, w2, k, scheme=scheme, vendor=CudaVendor())
        plain = moe.MoELayer.from_float(w13, w2, k, scheme=scheme, vendor=CudaVendor(), launch_plans=None)
    g = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(256, h, device="cuda", generator=g).to(torch.bfloat16)
            logits = torch.randn(256, e, device="cuda", generator=g)
            assert torch.equal(planned(x, logits), plain(x, logits))
    # the gather is a Triton launch, not a torch op; only a TMA-fed GEMM (launched through Triton's JIT) may refuse
    refusals = planned.launch_plan_refusals
    assert all("_grouped_gemm_tma" in reason for reason in refusals), refusals
