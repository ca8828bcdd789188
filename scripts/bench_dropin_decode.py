"""Greedy decode through the transformers drop-in, tokens per second, one process (CUDA, transformers installed).

A Qwen3-MoE of `--layers` decoder layers at qwen3-30b-a3b's real layer shape (hidden 2048, 128 experts, top-8,
expert intermediate 768), random bf16 weights, batch 1: `generate` of `--new-tokens` greedy tokens after a
16-token prompt, median of `--repeats` timed runs after one warm-up, for
- transformers' own MoE blocks,
- the drop-in (`moe.integrations.transformers.replace_moe_blocks`) as built (launch plans on, the default),
- the drop-in with `launch_plans=None` (every op issued from the host),
- the model with its MoE blocks returning zeros (what the rest of the model costs: the blocks' share of a decode
  step is 1 - zeroed / drop-in time),
- the drop-in with the model's forward under `torch.compile(backend="cudagraphs")` and a static cache,
- with `--reduce-overhead`, the same under `torch.compile(mode="reduce-overhead")` (inductor and CUDA graphs; on
  the H100 of 2026-12-07, torch 2.11 and transformers 5.17, it crashed inside inductor's own attention kernel,
  with launch plans and without).
Each mode's tokens are compared with the drop-in's first run.

    python scripts/bench_dropin_decode.py --layers 4 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import moe.integrations.transformers as moe_hf


class ZeroBlock(torch.nn.Module):
    """A MoE block that costs nothing: its output is zeros."""

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def _rate(
    model: torch.nn.Module, ids: torch.Tensor, new: int, repeats: int, sync, **kwargs: object
) -> tuple[float, list]:
    def run() -> torch.Tensor:
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)

    out = run()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = run()
        sync()
        times.append(time.perf_counter() - start)
    return new / statistics.median(times), out[0, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled modes")
    parser.add_argument("--reduce-overhead", action="store_true", help="add torch.compile(mode='reduce-overhead')")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the CPU vendor: a smoke run)")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        hidden_size=2048,
        moe_intermediate_size=768,
        intermediate_size=6144,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=args.layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        norm_topk_prob=True,
    )
    device = torch.device(args.device)
    vendor = "cuda" if device.type == "cuda" else "cpu"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with device:
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, config.vocab_size, (1, 16), device=device)
    rows: dict[str, float] = {}
    tokens: dict[str, list] = {}
    new, repeats = args.new_tokens, args.repeats
    with torch.no_grad():
        rows["transformers blocks"], tokens["transformers blocks"] = _rate(model, ids, new, repeats, sync)
        names = moe_hf.replace_moe_blocks(model, vendor=vendor)
        rows["drop-in eager"], tokens["drop-in eager"] = _rate(model, ids, new, repeats, sync)
        moe_hf.restore_moe_blocks(model)
        moe_hf.replace_moe_blocks(model, vendor=vendor, launch_plans=None)
        rows["drop-in eager, no plans"], tokens["drop-in eager, no plans"] = _rate(model, ids, new, repeats, sync)
        print("eager modes:", {k: round(v, 1) for k, v in rows.items()}, flush=True)
        blocks = {name: model.get_submodule(name) for name in names}
        for name in names:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, ZeroBlock())
        rows["MoE blocks zeroed"], _ = _rate(model, ids, new, repeats, sync)
        for name, block in blocks.items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, block)
        if not args.no_compile:
            moe_hf.restore_moe_blocks(model)
            moe_hf.replace_moe_blocks(model, vendor=vendor)
            modes = [("drop-in, cudagraphs compile, static cache", {"backend": "cudagraphs"})]
            if args.reduce_overhead:
                modes.append(("drop-in, reduce-overhead compile, static cache", {"mode": "reduce-overhead"}))
            for mode, options in modes:
                model.forward = torch.compile(type(model).forward.__get__(model), **options)
                start = time.perf_counter()
                rows[mode], tokens[mode] = _rate(
                    model, ids, new, repeats, sync, cache_implementation="static", disable_compile=True
                )
                print(
                    f"{mode}: {rows[mode]:.1f} tokens/s, {time.perf_counter() - start:.1f} s including compilation",
                    flush=True,
                )
                torch._dynamo.reset()
    reference = tokens["drop-in eager"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, {args.layers} layers, {new} new tokens, tokens/s (median of {repeats})")
    for mode, rate in rows.items():
        same = (
            ""
            if mode not in tokens
            else f" (tokens {'same as' if tokens[mode] == reference else 'differ from'} drop-in eager)"
        )
        print(f"  {mode:45s} {rate:8.1f}{same}")
    share = {
        mode: round(1 - rows[mode] / rows["MoE blocks zeroed"], 3)
        for mode in ("drop-in eager", "drop-in eager, no plans")
    }
    print("MoE blocks' share of an eager decode step:", share)
    print(json.dumps({"tokens_per_s": rows, "moe_share": share}))


if __name__ == "__main__":
    main()
