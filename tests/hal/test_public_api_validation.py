"""Every public entry of `moe` (and `hal.DispatchConfig` / `hal.resolve_dispatch_plan`) refuses a wrong
argument with a `HalError` whose message starts with the caller's argument name: no raw traceback, no
silently wrong result. One test per class of bad input an adversarial
user tried."""

from __future__ import annotations

import math

import pytest
import torch

import moe
from hal import DispatchConfig, HalError, InvalidInput, KNOWN_SCHEMES, QuantizedWeight, Vendor, resolve_dispatch_plan
from moe.compiled import register_layer
from moe.dispatch import VendorEpDispatcher
from vendors.cpu import CpuVendor

E, H, I, K = 4, 16, 8, 2


def raises(argument: str, error: type[HalError] = InvalidInput):
    """`pytest.raises` for a `HalError` subclass whose message starts with `argument:`."""
    return pytest.raises(error, match=r"^" + __import__("re").escape(argument) + ":")


def float_weights(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(E, H, 2 * I, generator=gen) / 4).to(dtype), (torch.randn(E, I, H, generator=gen) / 4).to(dtype)


@pytest.fixture
def layer(cpu: CpuVendor) -> moe.MoELayer:
    return moe.MoELayer.from_float(*float_weights(), K, vendor=cpu, environ={})


# -- vendor= and environ= ------------------------------------------------------------------------------


@pytest.mark.parametrize("vendor", [1, 2.5, b"cpu", "", "   ", ["cpu"], object()])
def test_a_vendor_that_is_no_vendor_or_name_is_refused(vendor):
    with raises("vendor"):
        moe.MoELayer(H, I, E, K, vendor=vendor, environ={})


@pytest.mark.parametrize(
    "environ",
    [
        ["HAL_VENDOR"],
        "HAL_VENDOR=cpu",
        3,
        {"HAL_DISPATCH_DTYPE": 1},
        {"HAL_VENDOR": None},
        {1: "cpu"},
        {"HAL_DISPATCH_DTYPE": b"bf16"},
    ],
)
def test_an_environ_that_is_no_mapping_of_str_to_str_is_refused(environ, cpu):
    with raises("environ"):
        moe.MoELayer(H, I, E, K, environ=environ)
    with raises("environ"):
        moe.MoELayer(H, I, E, K, vendor=cpu, environ=environ)  # checked even where it decides nothing
    with raises("environ"):
        resolve_dispatch_plan(cpu, H, environ=environ)


def test_environ_chooses_the_vendor_and_an_explicit_vendor_wins(cpu):
    chosen = moe.MoELayer(H, I, E, K, environ={"HAL_VENDOR": "ascend-emulated"})
    assert chosen.vendor.name == "ascend-emulated"
    assert chosen.plan.vendor == "ascend-emulated"
    assert moe.MoELayer(H, I, E, K, vendor="cpu", environ={"HAL_VENDOR": "ascend-emulated"}).vendor.name == "cpu"
    assert moe.MoELayer(H, I, E, K, vendor=cpu, environ={"HAL_VENDOR": "ascend-emulated"}).vendor is cpu
    both = moe.MoELayer(H, I, E, K, environ={"HAL_VENDOR": "cpu", "HAL_DISPATCH_DTYPE": "fp16"})
    assert (both.vendor.name, both.plan.resolved.value, both.plan.source.value) == ("cpu", "fp16", "environment")


# -- the forward's tensors -----------------------------------------------------------------------------


@pytest.mark.parametrize("argument", ["hidden_states", "router_logits", "topk_ids", "topk_weights"])
def test_a_forward_tensor_on_another_device_is_refused_by_its_name(layer, argument):
    x = torch.randn(3, H)
    logits = torch.randn(3, E)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.full((3, K), 0.5)
    precomputed = argument in ("topk_ids", "topk_weights")
    given = dict(
        hidden_states=x,
        router_logits=None if precomputed else logits,
        topk_ids=ids if precomputed else None,
        topk_weights=weights if precomputed else None,
    )
    given[argument] = given[argument].to("meta")
    with raises(argument):
        layer(
            given["hidden_states"],
            given["router_logits"],
            topk_ids=given["topk_ids"],
            topk_weights=given["topk_weights"],
        )


# -- routers -------------------------------------------------------------------------------------------

ROUTERS = {
    "softmax": lambda **kw: moe.SoftmaxTopK(8, 2, **kw),
    "sigmoid": lambda **kw: moe.SigmoidTopK(8, 2, **kw),
    "grouped": lambda **kw: moe.GroupedTopK(8, 2, num_groups=4, topk_groups=2, **kw),
    "grouped-sigmoid": lambda **kw: moe.GroupedSigmoidTopK(8, 2, num_groups=4, topk_groups=2, **kw),
}


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("factor", [math.inf, -math.inf, math.nan, 0.0, -1.0, True, "2", None])
def test_a_scaling_factor_that_is_no_finite_positive_number_is_refused(router, factor):
    with raises("routed_scaling_factor"):
        ROUTERS[router](routed_scaling_factor=factor)


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_a_flag_that_is_no_bool_is_refused_not_taken_for_its_truth(router, value):
    with raises("renormalize"):
        ROUTERS[router](renormalize=value)


def test_router_tensors_and_devices_are_checked():
    with raises("correction_bias"):
        moe.SigmoidTopK(8, 2, correction_bias=torch.zeros(8, device="meta"))
    with raises("weights_on_input"):
        moe.SigmoidTopK(8, 1, weights_on_input="yes")
    with raises("device"):
        moe.SoftmaxTopK(8, 2).to("no-such-device")
    with raises("topk_weights"):
        moe.Routing(torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 1))
    with raises("topk_ids"):
        moe.Routing([[0, 1]], torch.ones(1, 2))


# -- capacities, ints, flags of the layer and its configuration ----------------------------------------


class SmallDevice(CpuVendor):
    """A CPU vendor that states a 1 MiB device (the bound every capacity is checked against)."""

    name = "cpu-1mib"

    def device_memory_bytes(self) -> int | None:
        return 1 << 20


def test_a_low_latency_capacity_beyond_the_device_memory_is_refused_at_construction(cpu):
    with raises("max_dispatch_tokens_per_rank"):
        moe.MoELayer(H, I, E, K, vendor=cpu, environ={}, dispatch=DispatchConfig(max_dispatch_tokens_per_rank=10**13))
    small = SmallDevice()
    plan = resolve_dispatch_plan(small, H, environ={})
    fits = (1 << 20) // moe.LowLatencyDispatcher(plan, E, 1, vendor=small).memory_bytes
    assert moe.LowLatencyDispatcher(plan, E, fits, vendor=small).memory_bytes <= 1 << 20
    with raises("max_dispatch_tokens_per_rank"):
        moe.LowLatencyDispatcher(plan, E, fits + 1, vendor=small)
    with raises("max_dispatch_tokens_per_rank"):
        moe.MoELayer(
            H, I, E, K, vendor=small, environ={}, dispatch=DispatchConfig(max_dispatch_tokens_per_rank=fits + 1)
        )
    assert (
        moe.MoELayer(
            H, I, E, K, vendor=small, environ={}, dispatch=DispatchConfig(max_dispatch_tokens_per_rank=fits)
        ).dispatcher.capacity
        == fits
    )


def test_the_cpu_vendor_states_the_host_memory_and_the_default_is_unknown(cpu):
    memory = cpu.device_memory_bytes()
    assert isinstance(memory, int) and memory == Vendor.host_memory_bytes() > 0

    class Unknown(CpuVendor):
        name = "cpu-unknown-memory"
        device_memory_bytes = Vendor.device_memory_bytes

    assert Unknown().device_memory_bytes() is None


@pytest.mark.parametrize(
    "argument, value",
    [
        ("top_k", 2.0),
        ("top_k", True),
        ("hidden_size", "16"),
        ("num_experts", 4.0),
        ("intermediate_size", 0),
        ("bias", "no"),
        ("check_routing", 1),
        ("fused", "yes"),
        ("runners", {}),
        ("dispatch", {"dtype": "bf16"}),
        ("shared_experts", 8),
        ("router", "softmax"),
        ("scheme", None),
        ("scheme", 8),
        ("activation", 3),
    ],
)
def test_a_layer_argument_of_the_wrong_type_is_refused_by_its_name(cpu, argument, value):
    given = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, vendor=cpu, environ={})
    given[argument] = value
    with raises(argument):
        moe.MoELayer(**given)


def test_process_groups_are_named_as_given(cpu):
    with raises("process_group"):
        moe.MoELayer(H, I, E, K, vendor=cpu, environ={}, process_group=object())
    with raises("tp_group"):
        moe.MoELayer(H, I, E, K, vendor=cpu, environ={}, tp_group=object())


@pytest.mark.parametrize(
    "argument, value",
    [
        ("dtype", 3),
        ("dtype", None),
        ("max_dispatch_tokens_per_rank", 4.0),
        ("max_dispatch_tokens_per_rank", True),
        ("max_dispatch_tokens_per_rank", 0),
        ("ep_dispatcher", 3),
        ("ep_dispatcher", ""),
    ],
)
def test_dispatch_config_refuses_wrong_fields(argument, value):
    with raises(argument):
        DispatchConfig(**{argument: value})


@pytest.mark.parametrize(
    "argument, value",
    [
        ("config", "bf16"),
        ("capabilities", "cpu"),
        ("scheme", 3),
        ("runner_dtype", "bogus"),
        ("runner_dtype", 2),
        ("hidden_size", 16.0),
        ("hidden_size", True),
    ],
)
def test_resolve_dispatch_plan_refuses_wrong_arguments(cpu, argument, value):
    given = dict(config=None, scheme=None, runner_dtype=None, environ={}, capabilities=None)
    hidden = value if argument == "hidden_size" else H
    if argument != "hidden_size":
        given[argument] = value
    with raises(argument):
        resolve_dispatch_plan(cpu, hidden, **given)
    with raises("vendor"):
        resolve_dispatch_plan("cpu", H, environ={})


# -- weights -------------------------------------------------------------------------------------------


def test_weights_without_data_are_refused_before_anything_is_copied(cpu, layer):
    w13, w2 = float_weights()
    with raises("w13"):
        moe.MoELayer.from_float(w13.to("meta"), w2, K, vendor=cpu, environ={})
    with raises("w2"):
        layer.load_weights(w13, w2.to("meta"))
    biased = moe.MoELayer(H, I, E, K, vendor=cpu, environ={}, bias=True)
    with raises("w2_bias"):
        biased.load_weights(w13, w2, w13_bias=torch.zeros(E, 2 * I), w2_bias=torch.zeros(E, H, device="meta"))
    stored = layer.expert_weights
    meta = QuantizedWeight(stored.w2.data.to("meta"), stored.w2.layout)
    with raises("weights.w2.data"):
        layer.load_expert_weights(moe.ExpertWeights(stored.w13, meta))
    assert layer.expert_weights is stored  # a refused load changes nothing
    shared = moe.MoELayer(H, I, E, K, vendor=cpu, environ={}, shared_experts=moe.SharedExperts(I, gated=True))
    with raises("gate"):
        shared.load_shared_experts(w13[0], w2[0], torch.zeros(H, device="meta"))


@pytest.mark.parametrize(
    "argument, call",
    [
        ("scheme", lambda: moe.make_scheme(None)),
        ("scheme", lambda: moe.make_scheme(3)),
        ("amax", lambda: moe.nvfp4_global_scale(math.inf)),
        ("amax", lambda: moe.nvfp4_global_scale(True)),
        ("input_global_scale", lambda: moe.NvFp4(math.nan, 1.0)),
        ("input_scale", lambda: moe.W8A8Fp8(input_scale=0.0)),
        ("dtype", lambda: moe.Unquantized(torch.int8)),
        ("shared_experts.gated", lambda: moe.SharedExperts(8, gated="yes")),
        ("shared_experts.intermediate_size", lambda: moe.SharedExperts(8.0)),
        ("rank", lambda: moe.TensorShard(2, 2)),
        ("size", lambda: moe.TensorShard(0, 0)),
        ("layer", lambda: register_layer(object())),
    ],
)
def test_schemes_shared_experts_shards_and_the_op_registry_check_their_arguments(argument, call):
    with raises(argument):
        call()


# -- dispatchers ---------------------------------------------------------------------------------------


def test_dispatcher_constructors_check_their_arguments(cpu):
    plan = resolve_dispatch_plan(cpu, H, scheme=KNOWN_SCHEMES["unquantized"], environ={})
    with raises("plan"):
        moe.LocalDispatcher("bf16", E)
    with raises("vendor"):
        moe.LocalDispatcher(plan, E, vendor="cpu")
    with raises("num_experts"):
        moe.AllToAllDispatcher(plan, 4.0)
    with raises("max_dispatch_tokens_per_rank"):
        moe.LowLatencyDispatcher(plan, E, 0, vendor=cpu)
    with raises("process_group"):
        moe.AllToAllDispatcher(plan, E, object(), vendor=cpu)
    with raises("vendor"):
        VendorEpDispatcher(plan, E, None, vendor=None, name="mc2")  # type: ignore[arg-type]
    with raises("name"):
        VendorEpDispatcher(plan, E, None, vendor=cpu, name="")


# -- checkpoints ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argument, value",
    [
        ("bias", "no"),
        ("gate_up_interleaved", "no"),
        ("activation_gated", "yes"),
        ("static_input_scale", "yes"),
        ("fused_layout", 3),
        ("fused_layout", "sideways"),
        ("prefix", 3),
        ("local_experts", [0, 1]),
        ("tp_rank", 1.0),
    ],
)
def test_the_checkpoint_loader_refuses_wrong_settings(argument, value):
    fmt = "fp8" if argument == "static_input_scale" else "bf16"
    with raises(argument):
        moe.ExpertCheckpointLoader(fmt, E, H, I, **{argument: value})


def test_the_checkpoint_loader_refuses_tensors_without_data_and_bad_devices():
    loader = moe.ExpertCheckpointLoader("bf16", E, H, I)
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    with raises(name):
        loader.add(name, torch.zeros(H, I, dtype=torch.bfloat16, device="meta"))
    with raises("name"):
        loader.add(3, torch.zeros(H, I, dtype=torch.bfloat16))  # type: ignore[arg-type]
    with raises("device"):
        loader.build(device="no-such-device")


def test_load_safetensors_refuses_missing_unreadable_or_wrong_arguments(tmp_path):
    pytest.importorskip("safetensors")
    loader = moe.ExpertCheckpointLoader("bf16", E, H, I)
    with raises("paths"):
        moe.load_safetensors(tmp_path / "absent.safetensors", None, loader)
    with raises("paths"):
        moe.load_safetensors(3, None, loader)
    with raises("paths"):
        moe.load_safetensors([str(tmp_path), 3], None, loader)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x07not a safetensors file")
    with raises("paths"):
        moe.load_safetensors(garbage, None, loader)
    with raises("loader"):
        moe.load_safetensors(garbage, None, object())  # type: ignore[arg-type]
    with raises("prefix"):
        moe.load_safetensors(garbage, 3, loader)  # type: ignore[arg-type]
