"""`hal explain` approves exactly the plans a layer builds: `hal.plan_checks.layer_problems` against
`moe.MoELayer.from_float` on the same vendor, scheme, hidden size and activation."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch

from conformance.capability import build_scheme
from hal import KNOWN_SCHEMES, ActivationKind, DispatchConfig, HalError, get_vendor, parse_scheme, resolve_dispatch_plan
from hal.plan_checks import layer_problems
from moe import MoELayer

EXPERTS, INTERMEDIATE, TOP_K = 4, 32, 2
VENDORS = ["cpu", "ascend-emulated"]
SCHEMES = [*KNOWN_SCHEMES, "fp16", "fp32"]
HIDDEN = [256, 100, 1000, 36]
ACTIVATIONS = [ActivationKind.SILU_GLU, ActivationKind.GELU]


def _explain_verdict(vendor, caps, scheme: str, hidden: int, activation: ActivationKind) -> list[str]:
    """What `hal explain` refuses: a dispatch dtype resolution cannot give, then the layer checks."""
    try:
        resolve_dispatch_plan(vendor, hidden, config=DispatchConfig(), scheme=parse_scheme(scheme), environ={})
    except HalError as exc:
        return [str(exc)]
    return layer_problems(caps, parse_scheme(scheme), hidden, activation=activation)


def _builds(vendor, scheme: str, hidden: int, activation: ActivationKind) -> str | None:
    """None when a layer builds and loads weights, else the error it raised."""
    gen = torch.Generator().manual_seed(hidden)
    width = 2 * INTERMEDIATE if activation.gated else INTERMEDIATE
    w13 = torch.randn(EXPERTS, hidden, width, generator=gen) / hidden**0.5
    w2 = torch.randn(EXPERTS, INTERMEDIATE, hidden, generator=gen) / INTERMEDIATE**0.5
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
    for scheme, hidden, activation in itertools.product(SCHEMES, HIDDEN, ACTIVATIONS):
        problems = _explain_verdict(vendor, caps, scheme, hidden, activation)
        error = _builds(vendor, scheme, hidden, activation)
        if bool(problems) != bool(error):
            disagreements.append(
                f"{scheme} H={hidden} {activation}: explain says {problems or 'buildable'}, "
                f"the layer says {error or 'built'}"
            )
    assert not disagreements, "\n".join(disagreements)


def _explain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hal.cli", "explain", "--json", *args], capture_output=True, text=True, timeout=120
    )


def test_explain_refuses_a_plan_whose_grouped_matmul_is_not_declared():
    done = _explain("--vendor", "ascend-emulated", "--scheme", "w8a8-fp8-block")
    payload = json.loads(done.stdout)
    assert done.returncode == 1 and payload["buildable"] is False
    assert any("fp8-block128" in p for p in payload["problems"]), payload["problems"]


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
        problems = layer_problems(caps, parse_scheme(scheme), hidden)
        try:
            quant = build_scheme(scheme) if scheme in KNOWN_SCHEMES else scheme
            MoELayer(hidden, INTERMEDIATE, EXPERTS, TOP_K, scheme=quant, vendor=vendor)
            refused = None
        except HalError as exc:
            refused = str(exc)
        assert (refused is not None) == bool(problems), (scheme, hidden, problems, refused)
