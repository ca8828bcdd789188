"""`MoELayer.explanation` / `moe.explain.explain_layer` / `hal layer`: the choices it names are the ones the
layer made, every alternative comes with a reason, and a layer that cannot be built says why."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import moe
from conformance.capability import build_scheme
from hal import DispatchConfig, LayerSpec, get_vendor
from moe.dispatch import LocalDispatcher
from moe.explain import explain_layer
from moe.runners import RunnerKey, RunnerRegistry, run_grouped_experts
from tests.support.moe_reference import random_weights

E, H, I, K = 8, 256, 64, 2


@pytest.mark.parametrize("vendor", ["cpu", "ascend-emulated"])
@pytest.mark.parametrize("scheme", ["unquantized", "w8a8-int8", "w8a8-fp8-block"])
def test_the_explanation_names_what_the_layer_chose(vendor, scheme):
    w13, w2 = random_weights(E, H, I, 1)
    try:
        layer = moe.MoELayer.from_float(w13, w2, K, scheme=build_scheme(scheme), vendor=vendor, environ={})
    except Exception as exc:  # refused: the explanation of the same settings refuses too
        spec = LayerSpec(H, I, E, K, scheme=scheme)
        explained = explain_layer(get_vendor(vendor, environ={}), spec)
        assert not explained.buildable and explained.problems, exc
        return
    explained = layer.explanation
    assert explained.buildable and explained.plan.resolved == layer.plan.resolved
    assert explained.pipeline.startswith("fused") == layer.fused
    assert isinstance(layer.dispatcher, LocalDispatcher)
    assert explained.dispatcher.startswith("none: the fused op" if layer.fused else "local")
    assert (explained.runner.startswith("none")) == layer.fused
    names = {(a.what, a.name) for a in explained.rejected}
    assert {("dispatcher", "all-to-all"), ("dispatcher", "low-latency"), ("dispatcher", "auto")} <= names
    assert ("pipeline", "unfused" if layer.fused else "fused") in names
    assert all(a.reason for a in explained.rejected)
    text = explained.text()
    assert f"dispatch dtype: {layer.plan.resolved}" in text and "not dispatcher all-to-all:" in text


def test_a_vendors_own_runner_is_named_and_the_generic_one_set_aside():
    registry = RunnerRegistry.with_defaults(environ={})
    registry.register(RunnerKey("standard", "bf16", "unquantized", "cpu"), run_grouped_experts)
    w13, w2 = random_weights(E, H, I, 2)
    layer = moe.MoELayer.from_float(w13, w2, K, vendor="cpu", runners=registry, environ={})
    explained = layer.explanation
    assert "a runner registered by the caller" in explained.runner and ", cpu)" in explained.runner
    (generic,) = [a for a in explained.rejected if a.what == "runner"]
    assert "moe.run_grouped_experts" in generic.name and "the vendor's own runner" in generic.reason


def test_expert_parallel_settings_choose_the_dispatcher_by_the_layers_rule():
    vendor = get_vendor("cpu", environ={})
    spec = LayerSpec(H, I, E, K, ep_ranks=2, expert_parallel=True)
    for config, chosen in (
        (DispatchConfig(), "all-to-all"),
        (DispatchConfig(max_dispatch_tokens_per_rank=64), "low-latency"),
        (DispatchConfig(max_dispatch_tokens_per_rank=64, ep_mode="auto"), "auto"),
    ):
        explained = explain_layer(vendor, spec, dispatch=config)
        assert explained.dispatcher.startswith(chosen)
        assert chosen not in {a.name for a in explained.rejected if a.what == "dispatcher"}
        assert "local" in {a.name for a in explained.rejected}


def test_a_layer_that_cannot_be_built_is_explained_with_its_reasons():
    explained = explain_layer(get_vendor("ascend-emulated", environ={}), LayerSpec(100, I, E, K, scheme="w4a4-int4"))
    assert not explained.buildable
    assert any("int4 grouped matmul" in p for p in explained.problems)
    assert "refused:" in explained.text()


def _hal_layer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hal", "layer", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b"])
def test_hal_layer_explains_model_presets_on_a_declared_table(model):
    done = _hal_layer(
        "--model", model, "--vendor", "cuda", "--device-model", "H100", "--json", "--scheme", "unquantized"
    )
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["buildable"] and payload["dispatcher"] and payload["runner"]
    assert payload["table"] == "declared for device model H100"
    refused = _hal_layer("--model", model, "--vendor", "ascend-emulated", "--scheme", "w4a4-int4")
    assert refused.returncode == 1 and "refused:" in refused.stdout


def test_gpt_oss_preset_explains_its_mxfp4_checkpoint_weight_only():
    done = _hal_layer("--model", "gpt-oss-20b", "--vendor", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["buildable"] and "w4a16-mxfp4" in json.dumps(payload)
    text = _hal_layer("--model", "gpt-oss-20b", "--vendor", "cpu").stdout
    assert "dispatch dtype: bf16" in text and "from scheme" in text
    refused = _hal_layer("--model", "gpt-oss-20b", "--vendor", "ascend-emulated")
    assert refused.returncode == 1 and "no weight-only mxfp4" not in refused.stdout  # A3 (the emulated SoC)
    assert "bf16-mxfp4 grouped matmul" in refused.stdout and "no fp4 support" in refused.stdout
