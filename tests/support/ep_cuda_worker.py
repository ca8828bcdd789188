"""Expert parallelism on GPUs, one rank per device (launched by
`tests/vendors/cuda/test_moe_expert_parallel_cuda.py` through torchrun): every dispatcher the
vendor declares (the torch.distributed path in each mode, and its own, e.g. DeepEP) against the
single-rank layer at realistic shapes, the per-call mode of "auto", and a low-latency forward
captured in a CUDA graph. Rank 0 writes one JSON line per case to the file named by argv[1].
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

import hal
import moe

#: (experts, hidden, intermediate, top-k, tokens per rank (uneven: rank r routes tokens + 37 r))
SHAPES = ((256, 7168, 256, 8, 128), (64, 2048, 768, 8, 1000), (128, 1000, 384, 1, 300), (32, 2880, 2880, 4, 64))
#: max |ep - single| / max |single| allowed per dispatch dtype: the combine rounds each rank's partial sum to
#: the experts' dtype, and with fp8 a one-ulp change of an intermediate value can flip its fp8 rounding
TOLERANCE = {"bf16": 2**-6, "fp8": 2**-5}


def _inputs(experts: int, hidden: int, inter: int, tokens: int, world: int, device: torch.device) -> tuple:
    g = torch.Generator(device=device).manual_seed(experts * 7 + hidden)
    w13 = torch.randn(experts, hidden, 2 * inter, generator=g, device=device) / hidden**0.5
    w2 = torch.randn(experts, inter, hidden, generator=g, device=device) / inter**0.5
    counts = [tokens + 37 * r for r in range(world)]
    x = torch.randn(sum(counts), hidden, generator=g, device=device).to(torch.bfloat16)
    logits = torch.randn(sum(counts), experts, generator=g, device=device)
    return w13, w2, x, logits, counts


def _configs(vendor: hal.Vendor, tokens: int) -> list[tuple[str, hal.DispatchConfig]]:
    caps = vendor.capabilities()
    big = tokens + 37 * dist.get_world_size()
    out = [
        ("torch normal", dict()),
        ("torch low-latency", dict(max_dispatch_tokens_per_rank=big)),
        ("torch auto (fits)", dict(max_dispatch_tokens_per_rank=big, ep_mode="auto")),
        ("torch auto (over)", dict(max_dispatch_tokens_per_rank=tokens, ep_mode="auto")),
    ]
    for name in sorted(caps.ep_dispatchers):
        out.append((f"{name} normal", dict(ep_dispatcher=name)))
        if name in caps.ep_low_latency:
            out.append((f"{name} low-latency", dict(ep_dispatcher=name, max_dispatch_tokens_per_rank=big)))
    return out


def run_case(vendor: hal.Vendor, shape: tuple, scheme: str, dtype: str) -> list[dict[str, Any]]:
    experts, hidden, inter, k, tokens = shape
    rank, world = dist.get_rank(), dist.get_world_size()
    w13, w2, x, logits, counts = _inputs(experts, hidden, inter, tokens, world, vendor.device)
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    single = moe.MoELayer.from_float(w13, w2, k, scheme=scheme, vendor=vendor, dispatch=hal.DispatchConfig(dtype=dtype))
    ref = single(x[mine], logits[mine]).float()
    rows = []
    for label, extra in _configs(vendor, tokens):
        row: dict[str, Any] = {"case": label, "shape": list(shape), "scheme": scheme, "dtype": dtype}
        try:
            layer = moe.MoELayer.from_float(
                w13,
                w2,
                k,
                scheme=scheme,
                vendor=vendor,
                process_group=dist.group.WORLD,
                dispatch=hal.DispatchConfig(dtype=dtype, **extra),
            )
            out = layer(x[mine], logits[mine]).float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            row.update(
                mode=layer.dispatcher.last_mode,
                rel_err=err,
                ok=err <= TOLERANCE[dtype],
                resolved=str(layer.plan.resolved),
            )
        except hal.HalError as exc:
            row.update(skipped=f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - reported, the other ranks go on with the same cases
            row.update(ok=False, error=traceback.format_exc()[-1500:])
        flags = torch.tensor([1.0 if row.get("ok", True) else 0.0, row.get("rel_err", 0.0)], device=vendor.device)
        dist.all_reduce(flags[:1], op=dist.ReduceOp.MIN)
        dist.all_reduce(flags[1:], op=dist.ReduceOp.MAX)
        row.update(ok_all_ranks=bool(flags[0].item()), rel_err_max=flags[1].item())
        rows.append(row)
    return rows


def graph_case(vendor: hal.Vendor) -> dict[str, Any]:
    """A low-latency forward captured in a CUDA graph, replayed on new inputs, equals the eager call."""
    experts, hidden, inter, k, tokens = 64, 2048, 768, 8, 64
    w13, w2, x, logits, counts = _inputs(experts, hidden, inter, tokens, 1, vendor.device)
    layer = moe.MoELayer.from_float(
        w13,
        w2,
        k,
        vendor=vendor,
        process_group=dist.group.WORLD,
        dispatch=hal.DispatchConfig(dtype="bf16", max_dispatch_tokens_per_rank=tokens),
    )
    static_x, static_l = x[:tokens].clone(), logits[:tokens].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer(static_x, static_l)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static_out = layer(static_x, static_l)
    except Exception:  # noqa: BLE001
        return {"case": "graph low-latency", "ok": False, "error": traceback.format_exc()[-1500:]}
    g = torch.Generator(device=vendor.device).manual_seed(99 + dist.get_rank())
    static_x.copy_(torch.randn(static_x.shape, generator=g, device=vendor.device))
    static_l.copy_(torch.randn(static_l.shape, generator=g, device=vendor.device))
    graph.replay()
    eager = layer(static_x, static_l)
    torch.cuda.synchronize()
    return {"case": "graph low-latency", "ok": bool(torch.equal(static_out, eager))}


def main() -> int:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    vendor = hal.get_vendor("cuda")
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rows = []
    for shape in SHAPES:
        for scheme, dtype in (("unquantized", "bf16"), ("w8a8-fp8-block", "fp8")):
            rows += run_case(vendor, shape, scheme, dtype)
    rows.append(graph_case(vendor))
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
