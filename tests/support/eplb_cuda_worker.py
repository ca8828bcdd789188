"""One rank of `tests/vendors/cuda/test_cuda_ep_rebalance.py` under torchrun (NCCL, one GPU per rank): the
expert-parallel layer with redundant experts against the single-GPU layer before and after `rebalance()`,
and every moved buffer against the single-GPU layer's tensor of its new expert. Writes one JSON line per
(scheme, mode) and rank to the file named by argv[1] (rank r appends to `<file>.<r>`)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

E, H, I, K, T = 64, 2048, 768, 8, 512


def main(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import hal
    import moe
    from moe.routing_traces import RoutingTrace
    from vendors.cuda import CudaVendor

    warnings.simplefilter("ignore")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    rows = []
    for scheme in ("unquantized", "w8a8-fp8-block"):
        for capacity in (None, T):
            g = torch.Generator().manual_seed(7)
            w13 = torch.randn(E, H, 2 * I, generator=g) / H**0.5
            w2 = torch.randn(E, I, H, generator=g) / I**0.5
            vendor = CudaVendor()
            single = moe.MoELayer.from_float(w13, w2, K, scheme=scheme, vendor=vendor)
            layer = moe.MoELayer.from_float(
                w13,
                w2,
                K,
                scheme=scheme,
                vendor=vendor,
                process_group=dist.group.WORLD,
                redundant_experts=2 * world,
                load_stats=moe.LoadStats(window=4),
                dispatch=hal.DispatchConfig(max_dispatch_tokens_per_rank=capacity),
            )
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + rank)).to(torch.bfloat16).cuda()
            logits = RoutingTrace.parse("zipf:1.3").logits(T, E, seed=rank, device="cuda")
            ref = single(x, logits).float()

            def rel(y: torch.Tensor) -> float:
                return float((y.float() - ref).abs().max() / ref.abs().max())

            before = rel(layer(x, logits))
            placement = layer.rebalance()
            after = rel(layer(x, logits))
            first, buffers = layer.local_experts.start, dict(single.experts.named_buffers())
            exact = all(
                torch.equal(t, buffers[name][list(placement.slots[first : first + t.shape[0]])])
                for name, t in layer.experts.named_buffers()
                if t.dim() >= 1 and t.shape[0] == len(layer.local_experts)
            )
            moved = placement != moe.ExpertPlacement.default(E, 2 * world)
            rows.append(
                {
                    "scheme": scheme,
                    "capacity": capacity,
                    "before": before,
                    "after": after,
                    "exact": exact,
                    "moved": moved,
                }
            )
    Path(f"{out}.{rank}").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
