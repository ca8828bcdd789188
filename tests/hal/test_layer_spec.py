"""One answer to "can this layer be built": `hal.LayerSpec.problems` lists every reason, `hal explain`
and `moe.MoELayer` refuse exactly what it lists (against `MoELayer.from_float` on the same vendor,
scheme, hidden size and activation)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch

from conformance.capability import build_scheme
from hal import (
    KNOWN_SCHEMES,
    ActivationKind,
    DispatchConfig,
    HalError,
    InvalidInput,
    LayerSpec,
    UnsupportedCapability,
    get_vendor,
    parse_scheme,
    resolve_dispatch_plan,
)
from moe import MoELayer

EXPERTS, INTERMEDIATE, TOP_K = 4, 32, 2
VENDORS = ["cpu", "ascend-emulated"]
SCHEMES = [*KNOWN_SCHEMES, "fp16", "fp32"]
HIDDEN = [256, 100, 1000, 36]
#: the second projection's K: packed and block-scaled kinds need it whole in their blocks too
INTERMEDIATES = [INTERMEDIATE, 40, 36]
ACTIVATIONS = [ActivationKind.SILU_GLU, ActivationKind.GELU]


def _explain_verdict(
    vendor, caps, scheme: str, hidden: int, activation: ActivationKind, intermediate: int = INTERMEDIATE
) -> list[str]:
    """What `hal explain` refuses: a dispatch dtype resolution cannot give, then the layer checks."""
    try:
        resolve_dispatch_plan(vendor, hidden, config=DispatchConfig(), scheme=parse_scheme(scheme), environ={})
    except HalError as exc:
        return [str(exc)]
    spec = LayerSpec(hidden, intermediate, EXPERTS, TOP_K, scheme=scheme, activation=activation)
    return [p.message for p in spec.problems(caps)]


def _builds(
    vendor, scheme: str, hidden: int, activation: ActivationKind, intermediate: int = INTERMEDIATE
) -> str | None:
    """None when a layer builds and loads weights, else the error it raised."""
    gen = torch.Generator().manual_seed(hidden)
    width = 2 * intermediate if activation.gated else intermediate
    w13 = torch.randn(EXPERTS, hidden, width, generator=gen) / hidden**0.5
    w2 = torch.randn(EXPERTS, intermediate, hidden, generator=gen) / intermediate**0.5
    quant = build_scheme(scheme) if scheme in KNOWN_SCHEMES else scheme
    try:
        MoELayer.from_float(
            w13, w2, TOP_K, scheme=quant, vendor=vendor, activation=activation, dispatch=DispatchConfig(), environ={}
        )
    except HalError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("vendor_name", VENDORS)
def test_explain_approves_exactly_what_a_layer_builds(vendor_name):
    vendor = get_vendor(vendor_name, environ={})
    caps = vendor.capabilities()
    disagreements = []
    for scheme, hidden, activation, inter in itertools.product(SCHEMES, HIDDEN, ACTIVATIONS, INTERMEDIATES):
        problems = _explain_verdict(vendor, caps, scheme, hidden, activation, inter)
        error = _builds(vendor, scheme, hidden, activation, inter)
        if bool(problems) != bool(error):
            disagreements.append(
                f"{scheme} H={hidden} I={inter} {activation}: explain says {problems or 'buildable'}, "
                f"the layer says {error or 'built'}"
            )
    assert not disagreements, "\n".join(disagreements)


def _explain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hal.cli", "explain", "--json", *args], capture_output=True, text=True, timeout=120
    )


def test_explain_refuses_a_plan_whose_grouped_matmul_is_not_declared():
    done = _explain("--vendor", "ascend-emulated", "--scheme", "w4a4-int4")  # no scheme fallback declared
    payload = json.loads(done.stdout)
    assert done.returncode == 1 and payload["buildable"] is False
    assert any("int4 grouped matmul" in p for p in payload["problems"]), payload["problems"]


def test_explain_approves_a_plan_that_builds():
    done = _explain("--vendor", "cpu", "--scheme", "w8a8-fp8-block", "--hidden", "1000")
    payload = json.loads(done.stdout)
    assert done.returncode == 0 and payload["buildable"] is True and payload["problems"] == []


@pytest.mark.parametrize("vendor_name", VENDORS)
def test_a_layer_explain_refuses_is_refused_when_it_is_built_not_at_load(vendor_name):
    vendor = get_vendor(vendor_name)
    caps = vendor.capabilities()
    for scheme, hidden in itertools.product(SCHEMES, HIDDEN):
        try:
            resolve_dispatch_plan(vendor, hidden, config=DispatchConfig(), scheme=parse_scheme(scheme), environ={})
        except HalError:
            continue  # refused by the plan's resolution, which the layer runs first
        problems = LayerSpec(hidden, INTERMEDIATE, EXPERTS, TOP_K, scheme=scheme).problems(caps)
        try:
            quant = build_scheme(scheme) if scheme in KNOWN_SCHEMES else scheme
            MoELayer(hidden, INTERMEDIATE, EXPERTS, TOP_K, scheme=quant, vendor=vendor)
            refused = None
        except HalError as exc:
            refused = str(exc)
        assert (refused is not None) == bool(problems), (scheme, hidden, problems, refused)


def test_a_spec_lists_every_reason_at_once():
    caps = get_vendor("ascend-emulated", environ={}).capabilities()
    spec = LayerSpec(100, 64, 8, 2, scheme="w4a4-int4", activation=ActivationKind.GELU)
    settings = sorted(p.setting for p in spec.problems(caps))
    assert "scheme" in settings and "hidden_size" in settings, settings
    with pytest.raises(UnsupportedCapability) as raised:
        spec.check(caps, "ascend-emulated")
    message = str(raised.value)
    assert "int4 grouped matmul" in message and "hidden size 100" in message


def test_contradictory_settings_are_invalid_on_every_vendor():
    spec = LayerSpec(256, 96, 6, 8, ep_ranks=4, tp_ranks=5)
    assert sorted(p.setting for p in spec.problems(get_vendor("cpu", environ={}).capabilities())) == [
        "intermediate_size",
        "num_experts",
        "top_k",
    ]
    with pytest.raises(InvalidInput, match=r"top_k: expected at most num_experts \(6\), got 8.*expert-parallel ranks"):
        spec.check(get_vendor("cpu", environ={}).capabilities(), "cpu")


@pytest.mark.parametrize(
    "kwargs, field",
    [({"hidden_size": 0}, "hidden_size"), ({"top_k": -1}, "top_k"), ({"bias": "yes"}, "bias"), ({"fused": 1}, "fused")],
)
def test_a_malformed_setting_is_refused_when_the_spec_is_made(kwargs, field):
    settings = {"hidden_size": 64, "intermediate_size": 32, "num_experts": 4, "top_k": 2, **kwargs}
    with pytest.raises(InvalidInput, match=field):
        LayerSpec(**settings)


def test_explain_checks_the_layer_settings_it_is_given():
    done = _explain("--vendor", "cpu", "--hidden", "256", "--experts", "4", "--top-k", "8", "--ep-ranks", "3")
    payload = json.loads(done.stdout)
    assert done.returncode == 1 and payload["buildable"] is False
    assert any("top_k: expected at most num_experts (4), got 8" in p for p in payload["problems"]), payload
    assert any("expert-parallel ranks (3)" in p for p in payload["problems"]), payload


def test_a_layer_without_the_vendors_dispatcher_names_it():
    vendor = get_vendor("cpu", environ={})
    spec = LayerSpec(64, 32, 4, 2, expert_parallel=True, ep_dispatcher="deepep")
    (problem,) = spec.problems(vendor.capabilities())
    assert problem.unsupported and "'deepep'" in problem.message
    with pytest.raises(UnsupportedCapability, match="'deepep' is not declared"):
        spec.check(vendor.capabilities(), vendor.name)
    with pytest.raises(UnsupportedCapability, match="'deepep': expected a process_group.*'deepep' is not declared"):
        MoELayer(64, 32, 4, 2, vendor=vendor, dispatch=DispatchConfig(ep_dispatcher="deepep"), environ={})
