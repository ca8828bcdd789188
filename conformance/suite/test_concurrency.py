"""Two contracts of concurrency every vendor keeps, whatever it declares: (i) a result belongs to its
caller, so a later call with other inputs never changes a tensor an earlier call returned (a vendor
reusing one output buffer across calls breaks it); (ii) ops called from several threads at once give
what the same calls give one after the other (a layer may be called from several threads: the
vendor's ops must not share scratch state between calls). Equality is bit for bit, or within
`conformance.checks.NON_DETERMINISTIC_RELATIVE` where the vendor declares `deterministic=False`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from conformance.capability import CONCURRENCY, mark
from conformance.checks import same_result
from conformance.reference import generator
from hal import Groups, ScaleLayout, Vendor

pytestmark = mark(CONCURRENCY)

EXPERTS, HIDDEN, WIDTH, TOKENS, TOP_K = 16, 200, 96, 150, 4


def _calls(vendor: Vendor, seed: int) -> dict[str, Callable[[], torch.Tensor]]:
    """One call of each always-declared op on inputs drawn from `seed` (same shapes for every seed)."""
    gen, device = generator("concurrency", seed), vendor.device
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
    w = vendor.quantize_weight(
        (torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen) / 16).to(device), ScaleLayout.NONE, torch.bfloat16
    )
    counts = torch.bincount(torch.randint(0, EXPERTS, (TOKENS,), generator=gen), minlength=EXPERTS)
    groups = Groups.from_counts(counts.to(device))
    ids = torch.randint(0, EXPERTS, (TOKENS, TOP_K), generator=gen).to(device)
    weights = torch.rand(TOKENS, TOP_K, generator=gen).to(device)
    rows = torch.randn(TOKENS * TOP_K, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
    logits = torch.randn(TOKENS, EXPERTS, generator=gen).to(device)
    return {
        "grouped_matmul": lambda: vendor.grouped_matmul(x, w, groups),
        "grouped_matmul activated": lambda: vendor.grouped_matmul(x, w, groups, activation="silu-glu"),
        "swiglu": lambda: vendor.swiglu(x),
        "quantize": lambda: vendor.dequantize(vendor.quantize(x, vendor.capabilities().default_dispatch_dtype)),
        "weighted_combine": lambda: vendor.weighted_combine(rows, None, weights, torch.float32),
        "sort_by_expert": lambda: vendor.sort_by_expert(ids, EXPERTS)[0],
        "softmax_topk": lambda: vendor.softmax_topk(logits, TOP_K)[0],
    }


def test_a_result_is_not_changed_by_a_later_call(hal_vendor):
    first, later = _calls(hal_vendor, 0), _calls(hal_vendor, 1)
    for name, call in first.items():
        result = call()
        kept = result.clone()
        later[name]()
        assert torch.equal(result, kept), f"{name}: a later call changed the tensor an earlier call returned"


def test_calls_from_threads_equal_serial_calls(hal_vendor):
    cases = [(seed, name, call) for seed in range(2) for name, call in _calls(hal_vendor, seed).items()]
    serial = [call().clone() for _, _, call in cases]
    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(lambda case: case[2](), cases * 2))
    for i, got in enumerate(threaded):
        seed, name, _ = cases[i % len(cases)]
        assert same_result(hal_vendor, got, serial[i % len(cases)]), (
            f"{name} (inputs {seed}) differs when called from threads"
        )
