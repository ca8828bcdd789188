"""Scheme fallbacks: a scheme whose grouped-matmul kind the vendor lacks runs as the scheme the vendor declares
in its place, its weights converted once at load. For every declared fallback: the layer computes with the
target scheme and stores its format; its error against the float64 layer of the original weights (as the
scheme asked for stores them) stays within the vendor's declared bound; a second load of the original
format converts again to the same weights; a refused fallback is refused with its reason."""

from __future__ import annotations

import pytest
import torch

from conformance import reference
from conformance.capability import SCHEME_FALLBACKS, build_scheme, mark
from conformance.reference import generator, relative_error
from hal import KNOWN_SCHEMES, HalError, LayerSpec, choose_scheme
from moe import MoELayer
from moe.scheme_conversion import as_stored, holds_format

pytestmark = mark(SCHEME_FALLBACKS)

#: (experts, hidden, intermediate, top-k (the test takes 1 and 8), tokens) per depth: hidden a multiple of 128 (fp8 blocks), the
#: intermediate size not, so the last weight tiles are partial
SHAPES = {"quick": (32, 1024, 320, 8, 96), "full": (64, 2048, 704, 8, 257)}


def _declared(vendor, converted: bool) -> list[tuple[str, object]]:
    return [
        (name, f)
        for name, f in sorted(vendor.capabilities().scheme_fallbacks.items())
        if (f.target is not None) == converted
    ]


@pytest.mark.parametrize("top_k", [1, 8])
@pytest.mark.parametrize("scheme", ["w8a8-fp8-block", "w8a8-fp8", "w8a8-int8", "w4a4-int4", "nvfp4", "unquantized"])
def test_declared_scheme_fallback_stays_within_its_bound(hal_vendor, hal_depth, scheme, top_k):
    declared = dict(_declared(hal_vendor, converted=True))
    if scheme not in declared:
        pytest.skip(f"vendor {hal_vendor.name} declares no scheme fallback for {scheme}")
    fallback = declared[scheme]
    e, h, i, _, t = SHAPES[hal_depth]
    k = top_k
    gen = generator("scheme fallback", scheme)
    w13 = torch.randn(e, h, 2 * i, generator=gen) / h**0.5
    w2 = torch.randn(e, i, h, generator=gen) / i**0.5
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    logits = torch.randn(t, e, generator=gen)
    source = build_scheme(scheme)  # nvfp4 with global scales, as its checkpoints carry them
    layer = MoELayer.from_float(w13, w2, k, scheme=source, vendor=hal_vendor, environ={})
    assert layer.scheme.name == fallback.target and layer.source_scheme.name == scheme
    stored = layer.expert_weights
    assert holds_format(layer.scheme, stored.w13) and holds_format(layer.scheme, stored.w2)
    original = [torch.cat([as_stored(source, w[j : j + 1]) for j in range(e)]) for w in (w13, w2)]
    got = layer(x.to(hal_vendor.device), logits.to(hal_vendor.device))
    ids, weights = reference.softmax_topk(logits, k)
    error = relative_error(got, reference.moe_by_expert(x, ids, weights, *original))
    bound = fallback.max_error
    print(f"\n{hal_vendor.name}: {scheme} -> {fallback.target}: error {error:.4f} (declared bound {bound})")
    assert bound is None or error <= bound, (
        f"{scheme} converted to {fallback.target}: error {error:.4g} against the original weights exceeds the "
        f"declared bound {bound}"
    )


def test_refused_scheme_fallback_is_refused_with_its_reason(hal_vendor):
    refused = _declared(hal_vendor, converted=False)
    if not refused:
        pytest.skip(f"vendor {hal_vendor.name} refuses no scheme by a declared fallback")
    for name, fallback in refused:
        traits = KNOWN_SCHEMES[name]
        if traits.compute_kind is not None and hal_vendor.capabilities().supports_gemm(traits.compute_kind):
            continue
        spec_problems = [p.message for p in LayerSpec(1024, 512, 8, 2, scheme=name).problems(hal_vendor.capabilities())]
        assert any(fallback.reason in m for m in spec_problems), (name, spec_problems)
        if name != "nvfp4":  # nvfp4 needs global scales to be built at all
            with pytest.raises(HalError, match="scheme fallback is refused"):
                MoELayer(1024, 512, 8, 2, scheme=name, vendor=hal_vendor, environ={})


def test_every_known_scheme_runs_natively_converted_or_refused(hal_vendor):
    """What a vendor declares for each scheme decides what a layer of it does: its own kind runs as it is, a
    declared fallback converts, anything else is refused with a reason (every vendor, declared or not)."""
    caps = hal_vendor.capabilities()
    for name, traits in KNOWN_SCHEMES.items():
        choice = choose_scheme(caps, traits)
        kind = traits.compute_kind
        fallback = caps.scheme_fallbacks.get(name)
        if kind is None or caps.supports_gemm(kind):
            assert not choice.converted and choice.problem is None, (name, choice)
        elif fallback is not None and fallback.target is not None:
            assert choice.converted and choice.effective.name == fallback.target, (name, choice)
        else:
            assert choice.problem and (fallback is None or fallback.reason in choice.problem), (name, choice)
