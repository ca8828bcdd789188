"""DeepEP ("deepep", the CUDA vendor's expert-parallel dispatcher) on one host's GPUs, one process per GPU.

    torchrun --nproc-per-node 2 scripts/deepep_check.py [--ops-only] [--tokens 128 4096]

1. ops: `Vendor.prepare_ep` / `ep_dispatch` / `ep_combine` with name "deepep" for bf16 and fp8, normal mode
   and low-latency (capacity 128), against a dense reference (each expert scales its rows by 1 + e / E, so the
   combined output is `x * sum_j w_j (1 + e_j / E)`); the received counts against the all-gathered routing.
2. layers: `moe.MoELayer` with `DispatchConfig(ep_dispatcher="deepep")` (normal; low-latency with
   `max_dispatch_tokens_per_rank`; `ep_mode="auto"`, which switches per call) beside the same layer on the
   torch.distributed dispatcher and a single-rank layer holding every expert: max |y - y_single| / max |y_single|
   and max |y - y_torch| / max |y_torch|.

Rank 0 prints one table (errors: the largest over the ranks; times: the slowest rank's median). The exit status
is 0 when every check passed, 1 otherwise, 2 when the vendor does not declare deepep. Built for
scripts/deepep_device_check.sh (which builds DeepEP and launches this).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, installed or not

import hal  # noqa: E402
import moe  # noqa: E402
from bench.ep_world import World  # noqa: E402
from vendors.cuda import CudaVendor  # noqa: E402

DEEPEP = "deepep"
#: Relative error limits: bf16 rows (bf16 partial sums), fp8 rows against the same fp8 quantization.
TOLERANCE = {"bf16": 1e-2, "fp8": 2e-2}
#: fp8 in low-latency mode: DeepEP quantizes inside its kernel (`x * (448 / amax)`, ours `x / (amax / 448)`), so a
#: value on a rounding boundary lands one e4m3 step away; in the top binade a step is 32 / 448 = 0.071 of the max.
LOW_LATENCY_FP8_TOLERANCE = 0.08
#: deepep against the torch.distributed dispatcher and the single-rank layer (fp8 experts compute in fp8).
LAYER_TOLERANCE = {"bf16": 2e-2, "fp8": 5e-2}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096], help="tokens per rank")
    p.add_argument("--capacity", type=int, default=128, help="low-latency max_dispatch_tokens_per_rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=256, help="expert width of the layer check")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per case")
    p.add_argument("--ops-only", action="store_true", help="skip the layer checks")
    return p.parse_args()


class Report:
    """Rows of the final table; errors and times reduced over the ranks (every rank calls `add` alike)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.rows, self.failed = rank, [], False

    def add(
        self,
        check: str,
        dtype: str,
        mode: str,
        tokens: int,
        errors: dict[str, float],
        ms: float,
        limit: float,
        extra: str = "",
    ) -> None:
        values = torch.tensor([*errors.values(), ms], dtype=torch.float64, device="cuda")
        values = torch.nan_to_num(values, nan=float("inf"))
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        reduced = dict(zip(errors, values[:-1].tolist()))
        ok = all(v <= limit for v in reduced.values())
        self.failed |= not ok
        text = "  ".join(f"{k} {v:.2e}" for k, v in reduced.items())
        self.rows.append(
            f"{check:7s} {dtype:5s} {mode:12s} {tokens:5d}  {text:46s} {values[-1].item():8.3f} ms  "
            f"{'ok' if ok else 'FAIL'} (limit {limit:g}){extra}"
        )

    def error(self, check: str, dtype: str, mode: str, tokens: int, exc: BaseException) -> None:
        self.failed = True
        first = str(exc).splitlines()[0] if str(exc) else ""
        self.rows.append(f"{check:7s} {dtype:5s} {mode:12s} {tokens:5d}  ERROR {type(exc).__name__}: {first[:300]}")
        print(f"[rank {self.rank}] {check} {dtype} {mode} {tokens}: {traceback.format_exc()}", flush=True)

    def print(self) -> None:
        if self.rank == 0:
            print(
                "\ncheck   dtype mode         tokens  relative errors (max over ranks)               time/call",
                flush=True,
            )
            print("\n".join(self.rows), flush=True)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """The median of `repeats` CUDA-event timings of `fn()` after two warm-ups, the ranks lined up each time."""
    return World(torch.device("cuda", torch.cuda.current_device()), repeats, warmup=2).median_us(fn) / 1000.0


def relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, ARGS.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    weights, ids = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
    return x, ids, (weights / weights.sum(dim=-1, keepdim=True)).float()


def ops_case(vendor: hal.Vendor, report: Report, dtype: str, tokens: int, capacity: int | None) -> None:
    """One dispatch / experts / combine through the ops, against the dense reference."""
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    e, h = ARGS.experts, ARGS.hidden
    local, first = e // world, rank * (e // world)
    x, ids, w = routing(tokens, e, ARGS.top_k, 1000 * rank + tokens)
    vendor.prepare_ep(DEEPEP, process_group=group, num_experts=e, hidden_size=h, dtype=dtype, capacity=capacity)
    common = {
        "name": DEEPEP,
        "dtype": dtype,
        "num_experts": e,
        "process_group": group,
        "topk_weights": w,
        "capacity": capacity,
    }
    payload, counts, handle, *index = vendor.ep_dispatch(x, ids, **common)
    if index:  # the received tokens and the row of each pair
        payload = hal.take_rows(payload, index[0])
    gathered = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(gathered, ids)
    expected = torch.bincount(torch.cat(gathered).flatten(), minlength=e)[first : first + local]
    factor = 1 + (first + torch.arange(local, device="cuda", dtype=torch.float32)) / e
    rows = vendor.dequantize(payload, torch.float32)
    if capacity is None:
        rows = rows * factor[torch.repeat_interleave(torch.arange(local, device="cuda"), counts)].unsqueeze(-1)
    else:
        rows = rows * factor.view(-1, 1, 1)
    y_rows = rows.to(torch.bfloat16)
    out = vendor.ep_combine(y_rows, w, handle, name=DEEPEP, out_dtype=torch.bfloat16)
    xq = x.float() if dtype == "bf16" else vendor.dequantize(vendor.quantize(x, "fp8", layout="per-token-group-128"))
    ref = xq * (w * (1 + ids.float() / e)).sum(dim=-1, keepdim=True)

    def call() -> None:
        again = vendor.ep_dispatch(x, ids, **common)[2]
        vendor.ep_combine(y_rows, w, again, name=DEEPEP, out_dtype=torch.bfloat16)

    ms = median_ms(call, ARGS.repeats)
    counts_off = float((counts != expected).sum().item())
    mode = "normal" if capacity is None else f"low-lat.{capacity}"
    report.add(
        "ops",
        dtype,
        mode,
        tokens,
        {"vs dense": relative(out, ref), "counts off": counts_off},
        ms,
        LOW_LATENCY_FP8_TOLERANCE if dtype == "fp8" and capacity is not None else TOLERANCE[dtype],
        "  (dispatch+combine)",
    )


def layer_cases(vendor: hal.Vendor, report: Report, dtype: str) -> None:
    """deepep layers beside the torch.distributed ones and the single-rank layer, for one dispatch dtype."""
    e, h, i, k = ARGS.experts, ARGS.hidden, ARGS.intermediate, ARGS.top_k
    scheme = "unquantized" if dtype == "bf16" else "w8a8-fp8-block"
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, h, 2 * i, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5
    w2 = torch.randn(e, i, h, device="cuda", dtype=torch.bfloat16, generator=g) / i**0.5
    dist.broadcast(w13, 0)
    dist.broadcast(w2, 0)
    mine = torch.Generator(device="cuda").manual_seed(1 + dist.get_rank())  # each rank's own tokens
    inputs = {t: torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=mine) for t in ARGS.tokens}
    logits = {t: torch.randn(t, e, device="cuda", generator=mine) for t in ARGS.tokens}
    single = moe.MoELayer.from_float(w13, w2, k, scheme=scheme, vendor=vendor, dispatch=hal.DispatchConfig(dtype=dtype))
    expected = {t: single(inputs[t], logits[t]) for t in ARGS.tokens}
    del single
    torch_out: dict[tuple[str, int], torch.Tensor] = {}
    cap = ARGS.capacity
    variants = [(None, None, None), (DEEPEP, None, None), (None, cap, None), (DEEPEP, cap, None), (DEEPEP, cap, "auto")]
    for dispatcher, capacity, ep_mode in variants:
        label = dispatcher or "torch"
        mode = ep_mode or ("normal" if capacity is None else f"low-lat.{capacity}")
        tokens = [t for t in ARGS.tokens if capacity is None or ep_mode == "auto" or t <= capacity]
        try:
            extra = {} if ep_mode is None else {"ep_mode": ep_mode}
            layer = moe.MoELayer.from_float(
                w13,
                w2,
                k,
                scheme=scheme,
                vendor=vendor,
                process_group=dist.group.WORLD,
                dispatch=hal.DispatchConfig(
                    dtype=dtype, ep_dispatcher=dispatcher, max_dispatch_tokens_per_rank=capacity, **extra
                ),
            )
        except Exception as exc:
            for t in tokens:
                report.error("layer", dtype, f"{label} {mode}", t, exc)
            continue
        for t in tokens:
            try:
                y = layer(inputs[t], logits[t])
                errors = {"vs single": relative(y, expected[t])}
                if dispatcher is None:
                    torch_out[(mode, t)] = y
                elif (mode if ep_mode is None else "normal", t) in torch_out:
                    errors["vs torch"] = relative(y, torch_out[(mode if ep_mode is None else "normal", t)])
                ms = median_ms(lambda: layer(inputs[t], logits[t]), ARGS.repeats)
                report.add("layer", dtype, f"{label[:6]} {mode}", t, errors, ms, LAYER_TOLERANCE[dtype])
            except Exception as exc:
                report.error("layer", dtype, f"{label} {mode}", t, exc)
        del layer
        torch.cuda.empty_cache()


def main() -> int:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl", device_id=torch.device("cuda", local_rank), timeout=datetime.timedelta(seconds=120)
    )  # a rank that failed alone ends the run
    rank = dist.get_rank()
    vendor = CudaVendor()
    caps = vendor.capabilities()
    if rank == 0:
        print(
            f"{dist.get_world_size()} ranks on {caps.device_name}; ep_dispatchers={sorted(caps.ep_dispatchers)} "
            f"ep_low_latency={sorted(caps.ep_low_latency)} absent={dict(caps.ep_dispatchers_absent)}",
            flush=True,
        )
        for note in caps.notes:
            if "deepep" in note:
                print(f"note: {note}", flush=True)
    if DEEPEP not in caps.ep_dispatchers:
        print(
            f"[rank {rank}] ERROR: the CUDA vendor does not declare deepep: "
            f"{caps.ep_dispatchers_absent.get(DEEPEP, '?')}",
            flush=True,
        )
        dist.destroy_process_group()
        return 2
    report = Report(rank)
    for dtype in ("bf16", "fp8"):
        for tokens in ARGS.tokens:
            for capacity in (None, ARGS.capacity):
                if capacity is not None and tokens > capacity:
                    continue
                try:
                    ops_case(vendor, report, dtype, tokens, capacity)
                except Exception as exc:
                    report.error("ops", dtype, "normal" if capacity is None else "low-latency", tokens, exc)
    if not ARGS.ops_only:
        for dtype in ("bf16", "fp8"):
            layer_cases(vendor, report, dtype)
    report.print()
    vendor.ops.release_ep()  # type: ignore[attr-defined]
    dist.barrier()
    dist.destroy_process_group()
    return 1 if report.failed else 0


if __name__ == "__main__":
    ARGS = parse()
    sys.exit(main())
