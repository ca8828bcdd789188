"""The layer as an `nn.Module`: buffers, state dicts, `.to()`, no aliasing, precomputed routing,
non-finite logits, declared capabilities, and `torch.compile(fullgraph=True)` on the CPU vendor."""

from __future__ import annotations

import pytest
import torch

import moe
from hal import ActivationKind, Capabilities, DispatchConfig, InvalidInput, UnsupportedCapability, get_vendor
from tests.support.moe_reference import random_weights
from vendors.cpu import CpuVendor

E, H, I, K, T = 8, 144, 80, 2, 23


def _layer(scheme="unquantized", **kwargs):
    w13, w2 = random_weights(E, H, I, 3)
    return moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor="cpu", environ={}, **kwargs)


def _inputs(seed=0, tokens=T):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, H, generator=g).to(torch.bfloat16), torch.randn(tokens, E, generator=g)


@pytest.mark.parametrize(
    "scheme",
    [
        "unquantized",
        "w8a8-fp8-block",
        "w8a8-int8",
        "w4a4-int4",
        moe.NvFp4(moe.nvfp4_global_scale(5.0), moe.nvfp4_global_scale(3.0)),
    ],
    ids=["bf16", "fp8-block", "int8", "int4", "nvfp4"],
)
def test_state_dict_round_trips_onto_a_fresh_layer(scheme):
    dispatch = DispatchConfig(dtype="bf16") if isinstance(scheme, moe.NvFp4) else None
    layer = _layer(scheme, dispatch=dispatch)
    state = layer.state_dict()
    assert {"experts.w13_weight", "experts.w2_weight"} <= set(state)
    fresh = moe.MoELayer(H, I, E, K, scheme=scheme, vendor="cpu", environ={}, dispatch=dispatch)
    result = fresh.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    x, logits = _inputs()
    assert torch.equal(fresh(x, logits), layer(x, logits))
    for name, tensor in fresh.state_dict().items():
        assert tensor.dtype == state[name].dtype and tensor.data_ptr() != state[name].data_ptr(), name


def test_load_state_dict_reports_unexpected_keys():
    layer = _layer()
    state = dict(layer.state_dict(), **{"experts.bogus": torch.zeros(1)})
    with pytest.raises(InvalidInput, match="experts.bogus"):
        moe.MoELayer(H, I, E, K, vendor="cpu", environ={}).load_state_dict(state)


def test_to_moves_buffers_and_keeps_quantized_formats():
    layer = _layer("w8a8-fp8-block")
    x, logits = _inputs()
    before = layer(x, logits)
    dtypes = {n: t.dtype for n, t in layer.state_dict().items()}
    layer.half()  # a dtype conversion must not cast fp8 codes or fp32 scales
    assert {n: t.dtype for n, t in layer.state_dict().items()} == dtypes
    assert torch.equal(layer(x, logits), before)
    layer.to("meta")
    assert all(t.device.type == "meta" for t in layer.state_dict().values())
    assert all(t.device.type == "meta" for t in layer.expert_weights.w13.tensors().values())
    with pytest.raises(InvalidInput, match="device"):
        layer(x, logits)


@pytest.mark.parametrize("via", ["load_weights", "load_expert_weights"])
def test_the_layer_never_aliases_the_callers_tensors(via):
    w13, w2 = (w.to(torch.bfloat16) for w in random_weights(E, H, I, 5))
    b13, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    x, logits = _inputs()
    layer = moe.MoELayer(H, I, E, K, vendor="cpu", environ={}, bias=True)
    if via == "load_weights":
        layer.load_weights(w13, w2, w13_bias=b13, w2_bias=b2)
    else:
        from hal import QuantizedWeight

        layer.load_expert_weights(
            moe.ExpertWeights(QuantizedWeight(w13), QuantizedWeight(w2), w13_bias=b13, w2_bias=b2)
        )
    before = layer(x, logits)
    for t in (w13, w2, b13, b2):
        t.zero_()
    assert torch.equal(layer(x, logits), before)


def test_precomputed_routing_equals_the_router():
    layer = _layer()
    x, logits = _inputs()
    routing = moe.SoftmaxTopK(E, K)(logits)
    got = layer(x, topk_ids=routing.topk_ids.to(torch.int32), topk_weights=routing.topk_weights)
    assert torch.equal(got, layer(x, logits))
    three_d = layer(
        x.view(1, T, H), topk_ids=routing.topk_ids.view(1, T, K), topk_weights=routing.topk_weights.view(1, T, K)
    )
    assert torch.equal(three_d.view(T, H), got)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda l, x, lg, r: l(x, lg, topk_ids=r.topk_ids, topk_weights=r.topk_weights), "got both"),
        (lambda l, x, lg, r: l(x, topk_ids=r.topk_ids), "only one"),
        (lambda l, x, lg, r: l(x), "neither"),
        (lambda l, x, lg, r: l(x, topk_ids=r.topk_ids[:, :1], topk_weights=r.topk_weights[:, :1]), "topk_ids"),
        (lambda l, x, lg, r: l(x, topk_ids=r.topk_ids.float(), topk_weights=r.topk_weights), "topk_ids"),
        (lambda l, x, lg, r: l(x, topk_ids=r.topk_ids + E, topk_weights=r.topk_weights), r"\[0, 8\)"),
        (lambda l, x, lg, r: l(x, topk_ids=r.topk_ids, topk_weights=r.topk_weights * float("nan")), "finite"),
        (lambda l, x, lg, r: l(x, lg.to(torch.float8_e4m3fn)), "router_logits: expected a floating-point tensor .bf16"),
        (lambda l, x, lg, r: l(x, topk_ids=r.topk_ids, topk_weights=r.topk_weights.to(torch.float8_e5m2)), "topk_w"),
    ],
)
def test_bad_routing_inputs_raise_one_clear_error(call, match):
    layer = _layer()
    x, logits = _inputs()
    with pytest.raises(InvalidInput, match=match):
        call(layer, x, logits, moe.SoftmaxTopK(E, K)(logits))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_router_logits(bad):
    layer = _layer()
    x, logits = _inputs(tokens=600)
    logits[417, 3] = bad
    with pytest.raises(InvalidInput, match=r"router_logits: .*1 token\(s\) \(first: token 417\)"):
        layer(x, logits)
    unchecked = _layer(check_routing=False)
    clean = logits.clone()
    clean[417] = 0.0
    got, want = unchecked(x, logits), unchecked(x, clean)
    others = torch.arange(600) != 417
    assert torch.equal(got[others], want[others])  # a bad row never spreads to other rows


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_hidden_states_are_named_with_their_first_token(bad):
    layer = _layer()
    x, logits = _inputs(tokens=300)
    x[211, 5] = bad
    with pytest.raises(
        InvalidInput, match=r"^hidden_states: expected finite values.*1 token\(s\) \(first: token 211\)"
    ):
        layer(x, logits)
    layer = _layer(scheme="w8a8-int8")  # named as the caller's tensor, not as the quantizer's operand
    with pytest.raises(InvalidInput, match=r"^hidden_states: expected finite"):
        layer(x.view(3, 100, -1), logits.view(3, 100, -1))


def _cpu_without(**changes):
    base = get_vendor("cpu").capabilities()
    caps = Capabilities(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **changes})

    class Limited(CpuVendor):
        name = "cpu-limited"

        def _detect_capabilities(self):
            return caps

    return Limited()


def test_undeclared_activations_and_biases_are_refused():
    vendor = _cpu_without(activations=frozenset({ActivationKind.SILU_GLU}), expert_bias=False)
    with pytest.raises(UnsupportedCapability, match="gelu-glu"):
        moe.MoELayer(H, I, E, K, vendor=vendor, activation="gelu-glu", environ={})
    with pytest.raises(UnsupportedCapability, match="expert_bias"):
        moe.MoELayer(H, I, E, K, vendor=vendor, bias=True, environ={})
    with pytest.raises(UnsupportedCapability, match="gelu"):
        vendor.activate(torch.randn(2, 8), "gelu")
    moe.MoELayer(H, I, E, K, vendor=vendor, environ={})  # what it declares still builds


def test_the_fused_op_is_not_taken_for_experts_it_cannot_compute():
    vendor = get_vendor("ascend-emulated")
    with pytest.raises(UnsupportedCapability, match="SiLU-GLU"):
        moe.MoELayer(H, I, E, K, scheme="w8a8-int8", vendor=vendor, activation="gelu-glu", fused=True, environ={})
    layer = moe.MoELayer(H, I, E, K, scheme="w8a8-int8", vendor=vendor, bias=True, environ={})
    assert not layer.fused


def test_bias_arguments_must_match_the_layer():
    w13, w2 = random_weights(E, H, I, 1)
    with pytest.raises(InvalidInput, match="bias=False"):
        moe.MoELayer(H, I, E, K, vendor="cpu", environ={}).load_weights(
            w13, w2, w13_bias=torch.zeros(E, 2 * I), w2_bias=torch.zeros(E, H)
        )
    with pytest.raises(InvalidInput, match="only one"):
        moe.MoELayer(H, I, E, K, vendor="cpu", bias=True, environ={}).load_weights(
            w13, w2, w13_bias=torch.zeros(E, 2 * I)
        )
    with pytest.raises(InvalidInput, match="w2_bias"):
        moe.MoELayer(H, I, E, K, vendor="cpu", bias=True, environ={}).load_weights(
            w13, w2, w13_bias=torch.zeros(E, 2 * I), w2_bias=torch.zeros(E, H + 1)
        )


def test_shared_experts_need_a_declared_block_and_right_shapes():
    with pytest.raises(InvalidInput, match="shared_experts=moe.SharedExperts"):
        _layer().load_shared_experts(torch.zeros(H, 64), torch.zeros(32, H))
    layer = _layer(shared_experts=moe.SharedExperts(48, gated=True))
    with pytest.raises(InvalidInput, match=r"\(144, 96\)"):
        layer.load_shared_experts(torch.zeros(H, 48), torch.zeros(48, H))
    with pytest.raises(InvalidInput, match="gate"):
        layer.load_shared_experts(torch.zeros(H, 96), torch.zeros(48, H))
    x, logits = _inputs()
    with pytest.raises(InvalidInput, match="load_shared_experts"):
        layer(x, logits)


def test_compiled_layers_still_check_their_routing():
    torch._dynamo.reset()
    layer = _layer()
    compiled = torch.compile(layer, fullgraph=True)
    x, logits = _inputs()
    compiled(x, logits)
    logits[5, 1] = float("nan")
    with pytest.raises(InvalidInput, match="token 5"):
        compiled(x, logits)


def test_the_layer_op_passes_torch_library_opcheck():
    layer = _layer()
    x, logits = _inputs()
    r = layer.router(logits)
    for args in ((x, logits, None, None, layer._handle), (x, None, r.topk_ids, r.topk_weights, layer._handle)):
        torch.library.opcheck(
            torch.ops.moe_hal.moe_forward.default,
            args,
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
        )


def test_a_deep_copy_is_a_layer_of_its_own_compiled_too():
    import copy

    torch._dynamo.reset()
    layer = _layer()
    twin = copy.deepcopy(layer)
    w13, w2 = random_weights(E, H, I, 77)
    twin.load_weights(w13, w2)
    x, logits = _inputs()
    assert not torch.equal(twin(x, logits), layer(x, logits))
    for module in (layer, twin):
        assert torch.equal(torch.compile(module, fullgraph=True)(x, logits), module(x, logits))


@pytest.mark.parametrize("features", ["plain", "bias-shared-gelu", "precomputed", "fp8-block"])
def test_torch_compile_fullgraph_equals_eager(features):
    torch._dynamo.reset()
    kwargs, scheme = {}, "unquantized"
    if features == "bias-shared-gelu":
        kwargs = dict(activation="gelu-tanh-glu", shared_experts=moe.SharedExperts(64, gated=True))
    if features == "fp8-block":
        scheme = "w8a8-fp8-block"
    w13, w2 = random_weights(E, H, I, 9)
    if features == "bias-shared-gelu":
        layer = moe.MoELayer.from_float(
            w13, w2, K, w13_bias=torch.randn(E, 2 * I), w2_bias=torch.randn(E, H), vendor="cpu", environ={}, **kwargs
        )
        layer.load_shared_experts(torch.randn(H, 128) / 12, torch.randn(64, H) / 8, torch.randn(H) / 12)
    else:
        layer = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor="cpu", environ={})
    compiled = torch.compile(layer, fullgraph=True)
    for tokens in (T, 1, 57):  # a second and third size: the compiled graph serves other batch sizes
        x, logits = _inputs(tokens, tokens)
        if features == "precomputed":
            r = moe.SoftmaxTopK(E, K)(logits)
            got = compiled(x, topk_ids=r.topk_ids, topk_weights=r.topk_weights)
            want = layer(x, topk_ids=r.topk_ids, topk_weights=r.topk_weights)
        else:
            got, want = compiled(x, logits), layer(x, logits)
        assert torch.equal(got, want), features  # routing and experts run in the op: bit for bit eager
