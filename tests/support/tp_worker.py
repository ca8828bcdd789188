"""One rank of a gloo world for `tests/moe/test_moe_tensor_parallel.py`: tensor parallelism of the experts.

Run as `python tests/support/tp_worker.py --rank R --world W --init file://... --out DIR`. Rank r is
expert-parallel rank r // tp and tensor-parallel rank r % tp of each case's `ep x tp`
split. Every rank builds the parallel layer and, beside it, the single-process layer from
the same global weights, runs both on its tokens and writes the largest relative
difference per case to `<out>/rank<R>.json`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

HIDDEN, INTERMEDIATE, SHARED, EXPERTS, TOP_K, TOKENS = 160, 256, 384, 8, 3, 37


@dataclass(frozen=True)
class Case:
    """One parallel split and the experts' features."""

    name: str
    ep: int
    tp: int
    scheme: str = "fp32"
    activation: str = "silu-glu"
    bias: bool = False
    shared: bool = False
    #: (routed, shared) intermediate sizes; block-quantized cases keep every shard on 128-column blocks
    sizes: tuple[int, int] = (INTERMEDIATE, SHARED)
    #: load through `moe.checkpoint` from a synthetic FP8 block-128 checkpoint (each rank its own share)
    checkpoint: bool = False


def cases(world: int) -> list[Case]:
    """The cases a world of `world` ranks runs."""
    found = [
        Case("tp-fp32", 1, world),
        Case("tp-fp32-bias-gelu-shared", 1, world, activation="gelu-tanh-glu", bias=True, shared=True),
        Case("tp-oai-bias", 1, world, activation="swiglu-oai", bias=True),
        Case("tp-fp8-block", 1, world, scheme="w8a8-fp8-block", shared=True, sizes=(512, 512)),
        Case("tp-bf16", 1, world, scheme="bf16", bias=True),
    ]
    found.append(Case("ckpt-tp-fp8-block", 1, world, scheme="w8a8-fp8-block", sizes=(512, SHARED), checkpoint=True))
    if world == 4:
        found += [
            Case("ep2xtp2-fp32", 2, 2, bias=True, shared=True),
            Case("ep2xtp2-int8", 2, 2, scheme="w8a8-int8"),
            Case("ckpt-ep2xtp2-fp8-block", 2, 2, scheme="w8a8-fp8-block", sizes=(512, SHARED), checkpoint=True),
        ]
    return found


def build_from_checkpoint(case: Case, ep_group: object, tp_group: object, tp: tuple[int, int]) -> torch.nn.Module:
    """The layer of `case` loaded through `moe.checkpoint`: every rank reads the same synthetic
    checkpoint and keeps its experts and its intermediate shard."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import moe
    from tests.support.checkpoint_synthetic import encode_fp8_block, per_expert

    inter = case.sizes[0]
    stored = per_expert(lambda w, e, p: encode_fp8_block(w), HIDDEN, inter, EXPERTS, "layers.0.mlp", seed=3)
    layer = moe.MoELayer(
        HIDDEN, inter, EXPERTS, TOP_K, scheme="w8a8-fp8-block", vendor="cpu", process_group=ep_group, tp_group=tp_group
    )
    loader = moe.ExpertCheckpointLoader(
        "fp8-block128",
        EXPERTS,
        HIDDEN,
        inter,
        local_experts=layer.local_experts,
        tp_rank=tp[0],
        tp_size=tp[1],
        prefix="layers.0.mlp",
    )
    for name, tensor in stored.tensors.items():
        loader.add(name, tensor)
    return layer.load_expert_weights(loader.build())


def build(case: Case, ep_group: object, tp_group: object, tp: tuple[int, int] = (0, 1)) -> torch.nn.Module:
    """The layer of `case`, with deterministic global weights (the same on every rank)."""
    import moe

    if case.checkpoint:
        return build_from_checkpoint(case, ep_group, tp_group, tp)

    g = torch.Generator().manual_seed(7)
    inter, shared = case.sizes
    width = 2 * inter
    w13 = torch.randn(EXPERTS, HIDDEN, width, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, inter, HIDDEN, generator=g) / inter**0.5
    b13 = torch.randn(EXPERTS, width, generator=g) * 0.1 if case.bias else None
    b2 = torch.randn(EXPERTS, HIDDEN, generator=g) * 0.1 if case.bias else None
    scheme = {"fp32": moe.Unquantized(torch.float32), "bf16": moe.Unquantized(torch.bfloat16)}.get(
        case.scheme, case.scheme
    )
    layer = moe.MoELayer(
        HIDDEN,
        inter,
        EXPERTS,
        TOP_K,
        scheme=scheme,
        vendor="cpu",
        activation=case.activation,
        bias=case.bias,
        process_group=ep_group,
        tp_group=tp_group,
        shared_experts=moe.SharedExperts(shared, gated=True) if case.shared else None,
    )
    layer.load_weights(w13, w2, w13_bias=b13, w2_bias=b2)
    if case.shared:
        s13 = torch.randn(HIDDEN, 2 * shared, generator=g) / HIDDEN**0.5
        s2 = torch.randn(shared, HIDDEN, generator=g) / shared**0.5
        layer.load_shared_experts(s13, s2, torch.randn(HIDDEN, generator=g) / HIDDEN**0.5)
    return layer


def run(case: Case, rank: int, world: int) -> float:
    """Largest |parallel - single| / max |single| over this rank's tokens."""
    ep_rank, tp_rank = divmod(rank, case.tp)
    tp_groups = [dist.new_group([e * case.tp + t for t in range(case.tp)]) for e in range(case.ep)]
    ep_groups = [dist.new_group([e * case.tp + t for e in range(case.ep)]) for t in range(case.tp)]
    layer = build(
        case,
        ep_groups[tp_rank] if case.ep > 1 else None,
        tp_groups[ep_rank] if case.tp > 1 else None,
        (tp_rank, case.tp),
    )
    single = build(case, None, None)
    g = torch.Generator().manual_seed(11)
    dtype = torch.bfloat16 if case.scheme == "bf16" else torch.float32
    x = torch.randn(case.ep * TOKENS, HIDDEN, generator=g).to(dtype)
    logits = torch.randn(case.ep * TOKENS, EXPERTS, generator=g)
    mine = slice(ep_rank * TOKENS, (ep_rank + 1) * TOKENS - ep_rank * 5)  # uneven tokens per ep rank
    got, want = layer(x[mine], logits[mine]).double(), single(x[mine], logits[mine]).double()
    return float((got - want).abs().max() / want.abs().max())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.support.gloo_world import worker_main

    raise SystemExit(worker_main(cases, run))
