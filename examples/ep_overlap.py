"""Two micro-batches through an expert-parallel MoE layer: one after the other, then interleaved.

    torchrun --nproc-per-node 2 examples/ep_overlap.py [--tokens 4096] [--hidden 7168] [--experts 256]
        [--top-k 8] [--intermediate 512] [--dispatch-dtype bf16] [--mode normal|low-latency|auto] [--repeats 10]

Each rank splits its `--tokens` into two micro-batches and times, as the slowest rank's median over
`--repeats` (device synchronised and ranks lined up before each; device events where the accelerator
has them, else the wall clock):

- sequential: `layer(x0, logits0)`, then `layer(x1, logits1)`;
- interleaved, through the layer's stages (`MoELayer.start` / `run_experts` / `finish`): start both
  dispatches, run mb0's experts while mb1's dispatch travels, start mb0's combine, run mb1's experts
  while mb0's combine travels, start mb1's combine, wait for both.

It checks that the interleaved outputs equal the sequential ones bit for bit (exit status 1 if not) and
prints both times and their ratio on rank 0. The backend comes from the vendor's capabilities (gloo on
the CPU, NCCL on NVIDIA, HCCL on Ascend).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import hal
import moe

Batch = tuple[torch.Tensor, torch.Tensor]  # (hidden states [T, H], router logits [T, E])


def sequential(layer: moe.MoELayer, batches: list[Batch]) -> list[torch.Tensor]:
    """Each micro-batch through the whole layer in turn."""
    return [layer(x, logits) for x, logits in batches]


def interleaved(layer: moe.MoELayer, batches: list[Batch]) -> list[torch.Tensor]:
    """Two micro-batches through the layer's stages, each one's communication beside the other's experts."""
    (x0, logits0), (x1, logits1) = batches
    first = layer.start(x0, logits0)
    second = layer.start(x1, logits1)  # its dispatch travels while the first micro-batch's experts run
    first_done = layer.finish(layer.run_experts(first.wait()), first)
    second_done = layer.finish(layer.run_experts(second.wait()), second)  # beside the first one's combine
    return [first_done.wait(), second_done.wait()]


def synchronize() -> None:
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def median_ms(fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 2) -> float:
    """The slowest rank's median milliseconds of `fn()`."""
    times: list[float] = []
    for i in range(warmup + repeats):
        synchronize()
        dist.barrier()
        if torch.accelerator.is_available():  # device time between two events on the current stream
            start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            synchronize()
            elapsed = start.elapsed_time(end)
        else:
            began = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - began) * 1e3
        if i >= warmup:
            times.append(elapsed)
    slowest = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def build_layer(args: argparse.Namespace, device: torch.device, vendor: hal.Vendor) -> moe.MoELayer:
    """Random bf16 weights made on the device (each rank keeps only its own experts)."""
    g = torch.Generator(device).manual_seed(0)
    w13 = (
        torch.randn(args.experts, args.hidden, 2 * args.intermediate, generator=g, device=device, dtype=torch.bfloat16)
        / args.hidden**0.5
    )
    w2 = (
        torch.randn(args.experts, args.intermediate, args.hidden, generator=g, device=device, dtype=torch.bfloat16)
        / args.intermediate**0.5
    )
    capacity = None if args.mode == "normal" else (args.tokens + 1) // 2  # one micro-batch
    dispatch = hal.DispatchConfig(dtype=args.dispatch_dtype, max_dispatch_tokens_per_rank=capacity, ep_mode=args.mode)
    return moe.MoELayer.from_float(
        w13, w2, args.top_k, vendor=vendor, process_group=dist.group.WORLD, dispatch=dispatch, fused=False
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank (two micro-batches)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--dispatch-dtype", default="bf16")
    parser.add_argument("--mode", choices=["normal", "low-latency", "auto"], default="normal")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    if torch.accelerator.is_available():  # one device per process, without naming the device type
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
    vendor = hal.get_vendor()
    backend = vendor.capabilities().collective_backend
    dist.init_process_group(backend)
    device = vendor.device
    layer = build_layer(args, device, vendor)

    g = torch.Generator(device).manual_seed(1 + dist.get_rank())  # each rank its own tokens
    x = torch.randn(args.tokens, args.hidden, generator=g, device=device).to(torch.bfloat16)
    logits = torch.randn(args.tokens, args.experts, generator=g, device=device)
    batches = list(zip(x.chunk(2), logits.chunk(2)))

    expected, got = sequential(layer, batches), interleaved(layer, batches)
    equal = torch.tensor([int(all(torch.equal(a, b) for a, b in zip(expected, got)))], device=device)
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    one_by_one = median_ms(lambda: sequential(layer, batches), args.repeats, device)
    overlapped = median_ms(lambda: interleaved(layer, batches), args.repeats, device)
    if dist.get_rank() == 0:
        print(
            f"{dist.get_world_size()} ranks, {vendor.name} ({backend}), mode {args.mode} "
            f"(last call: {layer.dispatcher.last_mode}), dispatch {layer.plan.resolved}, "
            f"2 micro-batches of {batches[0][0].shape[0]} tokens per rank, H {args.hidden}, I {args.intermediate}, "
            f"{args.experts} experts, top-{args.top_k}"
        )
        print(
            f"sequential  {one_by_one:9.3f} ms\ninterleaved {overlapped:9.3f} ms  "
            f"(ratio interleaved / sequential {overlapped / one_by_one:.3f})"
        )
        print(f"interleaved equals sequential bit for bit on every rank: {bool(equal.item())}", flush=True)
    del layer  # it holds the group: free it now (it sits in reference cycles, hence gc), not while the
    gc.collect()  # interpreter exits, where gloo at times aborts ("terminate called without an active exception")
    dist.destroy_process_group()
    return 0 if equal.item() else 1


if __name__ == "__main__":
    raise SystemExit(main())
