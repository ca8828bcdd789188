"""One rank of a gloo world for `tests/moe/test_moe_stages.py`: a layer's stages against its forward.

Run as `python tests/support/stages_worker.py --rank R --world W --init file://... --out DIR`. For every case
each rank runs two micro-batches of its own (uneven sizes per rank) through `layer(...)`, through the
stages one micro-batch after the other, and through the stages interleaved (both dispatches started
before either micro-batch's experts), and records whether all three agree bit for bit and which mode
each dispatch took.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

HIDDEN, INTERMEDIATE, SHARED, EXPERTS, TOP_K = 96, 64, 48, 8, 2
#: tokens of (micro-batch 0, micro-batch 1) on rank r
TOKENS = ((5, 11), (6, 9))


@dataclass(frozen=True)
class Case:
    """One layer: its dispatch mode (with the low-latency capacity) and its features."""

    name: str
    mode: str = "normal"
    capacity: int | None = None
    scheme: str = "unquantized"
    shared: bool = False
    tp: bool = False  #: tensor parallel over the world instead of expert parallel
    llama4: bool = False  #: top-1 sigmoid routing whose weight scales the input
    precomputed: bool = False  #: topk_ids / topk_weights instead of logits, `[2, T/2, H]`-shaped input


def cases(world: int) -> list[Case]:
    """The cases every world runs."""
    return [
        Case("normal"),
        Case("low-latency", "low-latency", 11),
        Case("low-latency-int8", "low-latency", 12, scheme="w8a8-int8"),
        Case("auto-mixed", "auto", 8),  # micro-batch 0 fits the capacity on every rank, micro-batch 1 does not
        Case("auto-low-latency", "auto", 16),
        Case("normal-fp8-shared", scheme="w8a8-fp8-block", shared=True),
        Case("tp-shared", tp=True, shared=True),
        Case("llama4-shared", llama4=True, shared=True),
        Case("precomputed-low-latency", "low-latency", 12, precomputed=True),
    ]


def build(case: Case):
    """The layer of `case` with deterministic weights (the same global weights on every rank)."""
    import hal
    import moe

    g = torch.Generator().manual_seed(5)
    top_k = 1 if case.llama4 else TOP_K
    w13 = torch.randn(EXPERTS, HIDDEN, 2 * INTERMEDIATE, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, INTERMEDIATE, HIDDEN, generator=g) / INTERMEDIATE**0.5
    dispatch = hal.DispatchConfig(max_dispatch_tokens_per_rank=case.capacity, ep_mode=case.mode)
    router = moe.SigmoidTopK(EXPERTS, 1, weights_on_input=True) if case.llama4 else None
    group = {"tp_group" if case.tp else "process_group": dist.group.WORLD}
    layer = moe.MoELayer.from_float(
        w13,
        w2,
        top_k,
        scheme=case.scheme,
        vendor="cpu",
        dispatch=dispatch,
        router=router,
        **group,
        shared_experts=moe.SharedExperts(SHARED, gated=True) if case.shared else None,
    )
    if case.shared:
        layer.load_shared_experts(
            torch.randn(HIDDEN, 2 * SHARED, generator=g) / HIDDEN**0.5,
            torch.randn(SHARED, HIDDEN, generator=g) / SHARED**0.5,
            torch.randn(HIDDEN, generator=g),
        )
    return layer


def inputs(case: Case, rank: int, tokens: int, seed: int) -> tuple[tuple[torch.Tensor, ...], dict]:
    """A micro-batch's positional and keyword arguments for `forward` / `start`."""
    g = torch.Generator().manual_seed(100 * rank + seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, generator=g)
    if not case.precomputed:
        return (x, logits), {}
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    half = (2, tokens // 2) if tokens % 2 == 0 else (1, tokens)
    return (x.view(*half, HIDDEN),), {"topk_ids": ids.view(*half, TOP_K), "topk_weights": weights.view(*half, TOP_K)}


def staged_one_by_one(layer, batches) -> list[torch.Tensor]:
    out = []
    for args, kwargs in batches:
        started = layer.start(*args, **kwargs)
        out.append(layer.finish(layer.run_experts(started.wait()), started).wait())
    return out


def staged_interleaved(layer, batches) -> tuple[list[torch.Tensor], list[str]]:
    first = layer.start(*batches[0][0], **batches[0][1])
    modes = [layer.dispatcher.last_mode]
    second = layer.start(*batches[1][0], **batches[1][1])
    modes.append(layer.dispatcher.last_mode)
    first_done = layer.finish(layer.run_experts(first.wait()), first)
    second_done = layer.finish(layer.run_experts(second.wait()), second)
    return [first_done.wait(), second_done.wait()], modes


def run(case: Case, rank: int, world: int) -> dict:
    """Whether the stages (one by one and interleaved) equal `layer(...)` bit for bit, and the modes taken."""
    result = compare(case, rank)
    gc.collect()  # free the layer (it holds the group; reference cycles) now, not at exit, where gloo at times aborts
    return result


def compare(case: Case, rank: int) -> dict:
    layer = build(case)
    source = 0 if case.tp else rank  # tensor-parallel ranks share their tokens
    batches = [inputs(case, source, TOKENS[source % 2][i], i) for i in range(2)]
    expected = [layer(*args, **kwargs) for args, kwargs in batches]
    one_by_one = staged_one_by_one(layer, batches)
    interleaved, modes = staged_interleaved(layer, batches)
    again, _ = staged_interleaved(layer, batches)  # the low-latency buffer sets are reused
    equal = all(
        torch.equal(e, got) for results in (one_by_one, interleaved, again) for e, got in zip(expected, results)
    )
    shapes = all(e.shape == b[0][0].shape and e.dtype == b[0][0].dtype for e, b in zip(expected, batches))
    return {"equal": equal, "shapes": shapes, "modes": modes}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support.gloo_world import worker_main

    raise SystemExit(worker_main(cases, run))
