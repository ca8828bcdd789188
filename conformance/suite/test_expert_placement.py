"""Experts replicated and moved, for every scheme the vendor runs and declares movable: experts migrated
to other slots (each keeping its number of replicas) leave the output unchanged bit for bit (on a vendor
declaring `deterministic`; within rounding otherwise); replicas
added or removed change it only by rounding (a replica splits an expert's rows over two GEMM groups,
and a group's row count may change a GEMM's summation order): a relative (norm) difference within
2^-8, bf16's rounding step."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import build_scheme, layer_label, mark, require_scheme
from conformance.expectations import expected_resolution
from conformance.reference import generator, relative_error
from hal import KNOWN_SCHEMES
from moe import ExpertPlacement, MoELayer

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, REDUNDANT, TOKENS = 8, 256, 128, 2, 3, 41
ROUNDING = 2.0**-8


@pytest.mark.parametrize(
    "scheme", [pytest.param(s, marks=mark(layer_label(s))) for s, t in KNOWN_SCHEMES.items() if t.movable_experts]
)
def test_replicated_and_migrated_experts_leave_the_output_unchanged(hal_vendor, scheme):
    require_scheme(hal_vendor, scheme)
    if expected_resolution(hal_vendor.capabilities(), None, KNOWN_SCHEMES[scheme]).outcome == "rejected":
        pytest.skip(
            f"vendor {hal_vendor.name!r} carries no dispatch dtype of scheme {scheme} "
            "(test_moe_layer checks the refusal)"
        )
    gen = generator("placement", scheme)
    w13 = torch.randn(EXPERTS, HIDDEN, 2 * INTERMEDIATE, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=gen) / INTERMEDIATE**0.5
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen)
    logits[:, 1] += 2.0  # a busy expert, so that its replicas all receive tokens
    build = dict(scheme=build_scheme(scheme, input_amax=float(x.abs().max())), vendor=hal_vendor, environ={})
    plain = MoELayer.from_float(w13, w2, TOP_K, fused=False, **build)
    layer = MoELayer.from_float(w13, w2, TOP_K, fused=False, redundant_experts=REDUNDANT, **build)
    x, logits = x.to(hal_vendor.device), logits.to(hal_vendor.device)
    expected = plain(x, logits)
    replicated = layer(x, logits)
    error = relative_error(replicated, expected.double())
    assert error <= ROUNDING, f"redundant experts changed the output by {error:.3g} (relative, norm)"
    # every expert in another slot, expert 0..2 keeping their second replica
    moved = ExpertPlacement((2, 7, 1, 6, 5, 0, 4, 3, 1, 0, 2), EXPERTS)
    layer.rebalance(moved)
    assert layer.placement == moved
    if hal_vendor.capabilities().deterministic:  # else two runs may differ anyway: rounding is all we can ask
        assert torch.equal(layer(x, logits), replicated), "moving experts changed the layer's output"
    else:
        assert relative_error(layer(x, logits), replicated.double()) <= ROUNDING
    layer.rebalance(ExpertPlacement((1, 7, 1, 6, 5, 1, 4, 3, 2, 0, 1), EXPERTS))  # expert 1 takes three more
    error = relative_error(layer(x, logits), expected.double())
    assert error <= ROUNDING, f"a rebalance changed the output by {error:.3g} (relative, norm)"
