"""One rank of a gloo expert-parallel world for `tests/moe/test_moe_expert_parallel.py`.

Run as `python tests/support/ep_worker.py --rank R --world W --rendezvous DIR --out DIR`. The
rank joins the world (gloo, `file://` rendezvous in the first folder), runs every case of
`CASES` in order and writes one result file per case, `<out>/<case id>.rank<R>.pt`
(plain dicts of tensors, strings, numbers). The worker only computes; the test module
compares. A case that raises records its traceback; the ranks then start the next case
in a fresh process group (see `Membership`), and collectives time out rather than hang.

The case table (`tests.support.ep_cases`) is shared with the test module, which parametrizes over it.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the repository root makes `tests.support` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.ep_cases import (  # noqa: E402
    CAPACITY,
    capacity_for,
    Case,
    CASES,
    COLLECTIVE_TIMEOUT_S,
    dead_experts,
    HIDDEN,
    indivisible_experts,
    INTERMEDIATE,
    NUM_EXPERTS,
    OVERFLOW_CAPACITY,
    tokens_per_rank,
    TOP_K,
)


# -- inputs and layers -----------------------------------------------------------------------------


def float_weights(num_experts: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global fp32 expert weights, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + 7 * num_experts + hidden)
    w13 = torch.randn(num_experts, hidden, 2 * INTERMEDIATE, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, INTERMEDIATE, hidden, generator=g) / INTERMEDIATE**0.5
    return w13, w2


def global_inputs(case: Case, world: int, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states and router logits of every rank's tokens, concatenated in rank order."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{case.id}/{world}".encode()))
    total = sum(counts)
    x = torch.randn(total, case.hidden, generator=g)
    x[::3] *= 4.0  # rows of different magnitude, so per-token scales differ
    logits = 2.0 * torch.randn(total, NUM_EXPERTS, generator=g)
    if case.dead_experts:
        logits[:, dead_experts(world)] = -1e9
    return x.to(torch.bfloat16 if case.x_dtype == "bf16" else torch.float32), logits


def my_rows(counts: list[int], rank: int) -> slice:
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def make_router(case: Case) -> Any:
    import moe

    if case.router == "softmax":
        return None  # the layer's default SoftmaxTopK
    bias = 0.5 * torch.randn(NUM_EXPERTS, generator=torch.Generator().manual_seed(7))
    return moe.GroupedSigmoidTopK(
        NUM_EXPERTS, TOP_K, num_groups=4, topk_groups=2, correction_bias=bias, routed_scaling_factor=2.5
    )


def build_layer(case: Case, vendor: Any, *, process_group: Any, capacity: int | None) -> Any:
    import hal
    import moe

    w13, w2 = float_weights(NUM_EXPERTS, case.hidden)
    auto = case.auto_capacity is not None and process_group is not None
    config = hal.DispatchConfig(
        dtype=case.dtype, max_dispatch_tokens_per_rank=capacity, ep_mode="auto" if auto else None
    )
    return moe.MoELayer.from_float(
        w13,
        w2,
        TOP_K,
        scheme=case.scheme,
        vendor=vendor,
        dispatch=config,
        process_group=process_group,
        router=make_router(case),
    )


def describe_error(exc: BaseException) -> dict[str, Any]:
    import hal

    return {
        "raised": True,
        "error_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "is_invalid_input": isinstance(exc, hal.InvalidInput),
        "message": str(exc),
    }


# -- the cases -------------------------------------------------------------------------------------


def references(
    case: Case, vendor: Any, world: int, x: torch.Tensor, logits: torch.Tensor, mine: slice, capacity: int | None
) -> dict[str, Any]:
    """What one rank with every expert computes for `mine` of the concatenated tokens (`ref`: the plain
    single-rank layer, local dispatcher)."""
    single = build_layer(case, vendor, process_group=None, capacity=None)
    return {"ref": single(x, logits)[mine], "single_dispatcher": type(single.dispatcher).__name__}


def run_equal(case: Case, rank: int, world: int, vendor: Any) -> dict[str, Any]:
    """This rank's EP output and the single-rank references for the same tokens."""
    import torch.distributed as dist

    counts = tokens_per_rank(case.tokens, world)
    x, logits = global_inputs(case, world, counts)
    mine = my_rows(counts, rank)
    cap = capacity_for(case)
    ep = build_layer(case, vendor, process_group=dist.group.WORLD, capacity=cap)
    return {
        "out": ep(x[mine], logits[mine]),
        "mode": ep.dispatcher.last_mode,
        "dispatcher": type(ep.dispatcher).__name__,
        "local_experts": [ep.local_experts.start, ep.local_experts.stop],
        **references(case, vendor, world, x, logits, mine, cap),
    }


def run_format(case: Case, rank: int, world: int, vendor: Any) -> dict[str, Any]:
    """The raw low-latency dispatch output, plus every rank's routing and sent rows (all-gathered)."""
    import torch.distributed as dist

    counts = tokens_per_rank(case.tokens, world)
    x, logits = global_inputs(case, world, counts)
    mine = my_rows(counts, rank)
    cap = capacity_for(case)
    layer = build_layer(case, vendor, process_group=dist.group.WORLD, capacity=cap)
    x, logits = x[mine], logits[mine]
    routing = layer.router(logits)
    quantize = layer.scheme.dispatch_quantizer(layer.vendor, layer.plan, layer.expert_weights)
    out = layer.dispatcher.dispatch(x, routing, quantize)
    payload = out.payload

    # What this rank sent, as the receivers should see it: quantized, then dequantized.
    sent = layer.vendor.dequantize(quantize(x), torch.float32)
    ids = torch.full((cap, TOP_K), -1, dtype=torch.int64)
    ids[: x.shape[0]] = routing.topk_ids
    rows = torch.zeros(cap, case.hidden)
    rows[: x.shape[0]] = sent
    all_ids = [torch.empty_like(ids) for _ in range(world)]
    all_rows = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(all_ids, ids)
    dist.all_gather(all_rows, rows)
    return {
        "format": str(out.format),
        "payload_dtype": payload.dtype.value,
        "payload_layout": payload.layout.value,
        "plan_dtype": layer.plan.resolved.value,
        "plan_layout": layer.plan.scale_layout.value,
        "payload_shape": list(payload.data.shape),
        "payload_bytes": payload.data.contiguous().view(torch.uint8),
        "payload_scale": None if payload.scale is None else payload.scale.to(torch.float32),
        "payload_dequantized": layer.vendor.dequantize(payload, torch.float32),
        "expert_counts": out.expert_counts,
        "local_experts": [layer.local_experts.start, layer.local_experts.stop],
        "gathered_ids": torch.stack(all_ids),
        "gathered_rows": torch.stack(all_rows),
        "capacity": cap,
        "buffer_bytes": layer.dispatcher.buffer_bytes,
        "plan_buffer_bytes": layer.plan.buffer_bytes(world * cap),
        "bytes_per_token": layer.plan.bytes_per_token,
    }


def run_overflow(case: Case, rank: int, world: int, vendor: Any) -> dict[str, Any]:
    """Every rank sends more tokens than the capacity (each must raise before any collective),
    then a valid call on every rank must still match the single-rank layer."""
    import torch.distributed as dist

    cap = OVERFLOW_CAPACITY
    layer = build_layer(case, vendor, process_group=dist.group.WORLD, capacity=cap)
    g = torch.Generator().manual_seed(99 + rank)
    too_many = cap + 1 + rank
    result: dict[str, Any] = {"raised": False, "tokens_sent": too_many}
    try:
        layer(torch.randn(too_many, case.hidden, generator=g), torch.randn(too_many, NUM_EXPERTS, generator=g))
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        result.update(describe_error(exc))

    counts = [cap] * world
    x, logits = global_inputs(case, world, counts)
    mine = my_rows(counts, rank)
    result["out"] = layer(x[mine], logits[mine])
    result.update(references(case, vendor, world, x, logits, mine, cap))
    return result


def run_indivisible(case: Case, rank: int, world: int, vendor: Any) -> dict[str, Any]:
    """Build layers whose expert count the world size does not divide, two ways."""
    import hal
    import moe
    import torch.distributed as dist

    experts = indivisible_experts(world)
    config = hal.DispatchConfig(dtype="bf16", max_dispatch_tokens_per_rank=CAPACITY if case.low_latency else None)
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(experts, HIDDEN, 2 * INTERMEDIATE, generator=g)
    w2 = torch.randn(experts, INTERMEDIATE, HIDDEN, generator=g)
    builds = {
        "constructor": lambda: moe.MoELayer(
            HIDDEN, INTERMEDIATE, experts, TOP_K, vendor=vendor, dispatch=config, process_group=dist.group.WORLD
        ),
        "from_float": lambda: moe.MoELayer.from_float(
            w13, w2, TOP_K, vendor=vendor, dispatch=config, process_group=dist.group.WORLD
        ),
    }
    result: dict[str, Any] = {"num_experts": experts}
    for name, build in builds.items():
        try:
            layer = build()
        except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
            result[name] = describe_error(exc)
        else:
            result[name] = {"raised": False, "dispatcher": repr(layer.dispatcher)}
    return result


RUNNERS = {"equal": run_equal, "format": run_format, "overflow": run_overflow, "indivisible": run_indivisible}


def result_path(out: Path, case_id: str, rank: int) -> Path:
    return out / f"{case_id}.rank{rank}.pt"


def save(obj: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)  # readers never see a half-written file


class Membership:
    """This rank's place in the world: a gloo process group, re-created after a failed case.

    After each case the ranks compare outcomes through a separate file store. A rank whose
    case raised first drops its process group, so peers blocked in a collective with it
    fail at once instead of at the timeout; if any rank failed, every rank joins a fresh
    group (a new `file://` rendezvous) before the next case, so one failure never leaves
    the ranks out of step for the cases after it.
    """

    def __init__(self, rank: int, world: int, rendezvous: Path) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.rendezvous, self.epoch = rank, world, rendezvous, 0
        self.store = dist.FileStore(str(rendezvous / "outcomes"), world)
        self.store.set_timeout(timedelta(seconds=4 * COLLECTIVE_TIMEOUT_S))
        self._join()

    def _join(self) -> None:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=(self.rendezvous / f"group{self.epoch}").as_uri(),
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            gc.collect()  # free the cases' layers first: gloo at times aborts when they outlive the group
            dist.destroy_process_group()

    def settle(self, case_id: str, ok: bool) -> list[str]:
        """Wait for every rank's outcome of `case_id`; rejoin a fresh group if any failed."""
        if not ok:
            self.leave()
        self.store.set(f"{case_id}/{self.rank}", "ok" if ok else "failed")
        outcomes = [self.store.get(f"{case_id}/{r}").decode() for r in range(self.world)]
        if any(o != "ok" for o in outcomes):
            self.leave()
            self.epoch += 1
            self._join()
        return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rendezvous", type=Path, required=True, help="an empty folder for the file stores")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rank, world = args.rank, args.world
    torch.set_num_threads(1)

    import hal

    membership = Membership(rank, world, args.rendezvous)
    vendor = hal.get_vendor("cpu")
    failures = 0
    for case in CASES:
        started = time.monotonic()
        try:
            result = RUNNERS[case.kind](case, rank, world, vendor)
        except Exception:  # noqa: BLE001 - the traceback goes to the test
            result = {"error": traceback.format_exc()}
            print(f"[rank {rank}] case {case.id} failed:\n{result['error']}", file=sys.stderr, flush=True)
        save(result, result_path(args.out, case.id, rank))
        outcomes = membership.settle(case.id, "error" not in result)
        failures += any(o != "ok" for o in outcomes)
        print(
            f"[rank {rank}] {case.id}: {'/'.join(outcomes)} in {time.monotonic() - started:.2f}s",
            file=sys.stderr,
            flush=True,
        )
    membership.leave()
    print(f"[rank {rank}] {len(CASES)} cases, {failures} failed on some rank", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
