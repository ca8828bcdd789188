"""Expert-parallel MoE with moe-hal: every rank runs the same code on whatever vendor `hal` picks.

Launch one process per device:

    torchrun --nproc-per-node 2 examples/expert_parallel.py [--scheme w8a8-fp8-block] [--tokens 64]

The collective backend comes from the vendor's capabilities (gloo on the CPU, NCCL on
NVIDIA, HCCL on Ascend). Each rank routes its own tokens through the expert-parallel
layer (normal all-to-all and low-latency) and checks the result against a single-rank
layer holding every expert, then prints the dispatch plan and the largest difference.
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
    single = moe.MoELayer.from_float(w13, w2, args.top_k, **config,
                                     dispatch=hal.DispatchConfig(dtype=args.dispatch_dtype))
    expected = single(x, logits)[mine]
    for name, capacity in (("all-to-all", None), ("low-latency", args.tokens)):
        layer = moe.MoELayer.from_float(
            w13, w2, args.top_k, **config, process_group=dist.group.WORLD,
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
        print(f"rank {rank}/{world} {vendor.name} ({backend}) {name:11s} scheme={args.scheme} "
              f"dispatch={layer.plan.resolved} ({layer.plan.source}) experts {layer.local_experts.start}-"
              f"{layer.local_experts.stop - 1}: max |ep - single| = {diff:.3g} (of {scale:.3g}), "
              f"exact={torch.equal(y, expected)}, {elapsed * 1e3:.2f} ms/call", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
