"""One rank of a gloo world for `tests/vendors/ascend/test_ascend_mc2.py`: the MC2 dispatcher on the Ascend emulation.

Run as `python tests/support/mc2_worker.py --rank R --world W --init file://... --out DIR`. Every rank
builds the expert-parallel layer with `DispatchConfig(ep_dispatcher="mc2")` and, beside it,
the single-rank layer from the same global weights on the same emulated vendor, runs both on
its own tokens and writes the largest relative difference per case to `<out>/rank<R>.json`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

EXPERTS, TOP_K, TOKENS = 8, 3, 12


@dataclass(frozen=True)
class Case:
    """A scheme, the dispatch dtype and the emulated SoC (A3's MC2 ops take H = 7168 only)."""

    name: str
    scheme: str
    dtype: str
    soc: str = "Ascend910B3"
    hidden: int = 256
    intermediate: int = 96


CASES = [
    Case("a2-bf16", "unquantized", "bf16"),
    Case("a2-int8", "w8a8-int8", "int8"),
    Case("a3-bf16-h7168", "unquantized", "bf16", "Ascend910_9392", 7168, 128),
]


def run(case: Case, rank: int, world: int) -> float:
    """Largest |mc2 - single| / max |single| over this rank's tokens."""
    import moe
    from hal import DispatchConfig
    from vendors.ascend.emulation.vendor import EmulatedAscendVendor

    vendor = EmulatedAscendVendor(case.soc, deep_ep=False, environ={})
    g = torch.Generator().manual_seed(5)
    h, i = case.hidden, case.intermediate
    w13 = torch.randn(EXPERTS, h, 2 * i, generator=g) / h**0.5
    w2 = torch.randn(EXPERTS, i, h, generator=g) / i**0.5
    x = torch.randn(world * TOKENS, h, generator=g).to(torch.bfloat16)
    logits = torch.randn(world * TOKENS, EXPERTS, generator=g)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    build = dict(scheme=case.scheme, vendor=vendor, environ={}, fused=False)
    layer = moe.MoELayer.from_float(
        w13,
        w2,
        TOP_K,
        process_group=dist.group.WORLD,
        dispatch=DispatchConfig(dtype=case.dtype, ep_dispatcher="mc2"),
        **build,
    )
    single = moe.MoELayer.from_float(w13, w2, TOP_K, dispatch=DispatchConfig(dtype=case.dtype), **build)
    assert type(layer.dispatcher).__name__ == "VendorEpDispatcher", layer.dispatcher
    got, want = layer(x[mine], logits[mine]).double(), single(x[mine], logits[mine]).double()
    return float((got - want).abs().max() / want.abs().max())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support.gloo_world import worker_main

    raise SystemExit(worker_main(lambda world: CASES, run))
