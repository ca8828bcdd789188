"""Expert-parallel MoE with moe-hal: every rank runs the same code on whatever vendor `hal` picks.

Launch one process per device:

    torchrun --nproc-per-node 2 examples/expert_parallel.py [--scheme w8a8-fp8-block] [--tokens 64] [--bandwidth]

The collective backend comes from the vendor's capabilities (gloo on the CPU, NCCL on
NVIDIA, HCCL on Ascend). Each rank routes its own tokens through the expert-parallel
layer (normal all-to-all and low-latency) and checks the result against a single-rank
layer holding every expert, then prints the dispatch plan and the largest difference.
With `--bandwidth` it also times dispatch and combine alone and prints the bytes each rank
moves per second (the plan's bytes per token times its routed pairs, over the median time).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import hal
import moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="unquantized")
    parser.add_argument("--dispatch-dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--bandwidth", action="store_true", help="also time dispatch and combine alone")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.accelerator.is_available():  # one device per process, without naming the device type
        torch.accelerator.set_device_index(local_rank)
    vendor = hal.get_vendor()
    backend = vendor.capabilities().collective_backend
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = vendor.device

    g = torch.Generator().manual_seed(0)  # the same weights and inputs on every rank
    w13 = torch.randn(args.experts, args.hidden, 2 * args.intermediate, generator=g) / args.hidden**0.5
    w2 = torch.randn(args.experts, args.intermediate, args.hidden, generator=g) / args.intermediate**0.5
    x = torch.randn(world * args.tokens, args.hidden, generator=g).to(torch.bfloat16).to(device)
    logits = torch.randn(world * args.tokens, args.experts, generator=g).to(device)
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)

    config = {"scheme": args.scheme, "vendor": vendor}
    single = moe.MoELayer.from_float(
        w13, w2, args.top_k, **config, dispatch=hal.DispatchConfig(dtype=args.dispatch_dtype)
    )
    expected = single(x, logits)[mine]
    for name, capacity in (("all-to-all", None), ("low-latency", args.tokens)):
        layer = moe.MoELayer.from_float(
            w13,
            w2,
            args.top_k,
            **config,
            process_group=dist.group.WORLD,
            dispatch=hal.DispatchConfig(dtype=args.dispatch_dtype, max_dispatch_tokens_per_rank=capacity),
        )
        y = layer(x[mine], logits[mine])  # warm-up and result
        dist.barrier()
        start = time.perf_counter()
        for _ in range(5):
            layer(x[mine], logits[mine])
        dist.barrier()
        elapsed = (time.perf_counter() - start) / 5
        diff = (y.float() - expected.float()).abs().max().item()
        scale = expected.float().abs().max().item()
        print(
            f"rank {rank}/{world} {vendor.name} ({backend}) {name:11s} scheme={args.scheme} "
            f"dispatch={layer.plan.resolved} ({layer.plan.source}) experts {layer.local_experts.start}-"
            f"{layer.local_experts.stop - 1}: max |ep - single| = {diff:.3g} (of {scale:.3g}), "
            f"exact={torch.equal(y, expected)}, {elapsed * 1e3:.2f} ms/call",
            flush=True,
        )
        if args.bandwidth:
            report_bandwidth(layer, x[mine], logits[mine], name)
    del layer, single  # the layers hold the group: free them before it (gloo can abort at exit otherwise)
    dist.destroy_process_group()


def _synchronize() -> None:
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def _median_seconds(fn, repeats: int = 20) -> float:
    """Median wall time of `fn()` with the device synchronised around each call, across ranks."""
    times = []
    for _ in range(repeats + 3):
        _synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        _synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[3:])[len(times[3:]) // 2]


def report_bandwidth(layer: moe.MoELayer, x: torch.Tensor, logits: torch.Tensor, name: str) -> None:
    """Time the layer's dispatch and its combine alone; print each rank's bytes per second."""
    routing = layer.router(logits)
    quantize = layer.scheme.dispatch_quantizer(layer.vendor, layer.plan, layer.expert_weights)
    dispatched = layer.dispatcher.dispatch(x, routing, quantize)
    rows = torch.zeros(*dispatched.payload.data.shape[:-1], x.shape[-1], dtype=torch.bfloat16, device=x.device)
    dispatch_s = _median_seconds(lambda: layer.dispatcher.dispatch(x, routing, quantize))
    combine_s = _median_seconds(lambda: layer.dispatcher.combine(rows, dispatched, torch.bfloat16))
    pairs = routing.topk_ids.numel()
    sent, returned = pairs * layer.plan.bytes_per_token, pairs * x.shape[-1] * 2
    print(
        f"rank {dist.get_rank()} {name:11s} {x.shape[0]} tokens x top-{layer.top_k}: dispatch "
        f"{dispatch_s * 1e6:.0f} us ({sent / dispatch_s / 1e9:.1f} GB/s of {layer.plan.resolved} records, "
        f"{layer.plan.bytes_per_token} B/token), combine {combine_s * 1e6:.0f} us "
        f"({returned / combine_s / 1e9:.1f} GB/s of bf16 rows)",
        flush=True,
    )


if __name__ == "__main__":
    main()
