"""Serve one MoE layer of a pre-quantized checkpoint from safetensors, as the README shows.

Without a path, it first writes a small DeepSeek-V3-style FP8 block-128 layer (random
weights, 32 experts, two shared experts, grouped sigmoid routing) to a temporary folder in
the checkpoint's own on-disk layout: e4m3 `weight` `[N, K]` and fp32 `weight_scale_inv`
`[ceil(N/128), ceil(K/128)]` per expert projection. Then, as an engine would:

    pip install 'moe-hal[checkpoint]'                     # safetensors
    python examples/serve_checkpoint.py                  # synthetic checkpoint
    python examples/serve_checkpoint.py --vendor cuda    # the same on a GPU

It loads the routed experts through `moe.checkpoint` (nothing dequantized), the shared
experts through the same loader, builds the layer and compares one forward with the
float64 MoE of the dequantized checkpoint.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from _requires import require

require("safetensors", "checkpoint", "reading a safetensors checkpoint")

import torch  # noqa: E402

import moe  # noqa: E402
from hal import FP8_MAX  # noqa: E402
from moe.checkpoint import ExpertCheckpointLoader, load_safetensors  # noqa: E402

PREFIX = "model.layers.3.mlp"
E, H, I, SHARED, TOP_K, GROUPS, TOPK_GROUPS = 32, 1024, 256, 2, 4, 4, 2


def fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` `[N, K]` as e4m3 codes and fp32 `weight_scale_inv` per 128x128 tile (w = q * s)."""
    n, k = w.shape
    tiles = torch.zeros(math.ceil(n / 128), math.ceil(k / 128))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for a in range(tiles.shape[0]):
        for b in range(tiles.shape[1]):
            block = w[a * 128 : (a + 1) * 128, b * 128 : (b + 1) * 128]
            s = float(block.abs().max().clamp_min(1e-12)) / FP8_MAX
            tiles[a, b] = s
            q[a * 128 : (a + 1) * 128, b * 128 : (b + 1) * 128] = (block / s).to(torch.float8_e4m3fn)
    return q, tiles


def write_synthetic(folder: Path) -> Path:
    """A one-layer FP8 block-128 checkpoint in DeepSeek-V3's names; returns its file."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}

    def projection(name: str, out: int, inp: int) -> None:
        q, s = fp8_block(torch.randn(out, inp, generator=g) / inp**0.5)
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = q, s

    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            projection(f"{PREFIX}.experts.{e}.{proj}", *shape)
    for proj, shape in (("gate_proj", (SHARED * I, H)), ("up_proj", (SHARED * I, H)), ("down_proj", (H, SHARED * I))):
        projection(f"{PREFIX}.shared_experts.{proj}", *shape)
    tensors[f"{PREFIX}.gate.weight"] = torch.randn(E, H, generator=g) / H**0.5
    tensors[f"{PREFIX}.gate.e_score_correction_bias"] = torch.randn(E, generator=g) * 0.1
    path = folder / "model-00001-of-00001.safetensors"
    save_file(tensors, str(path))
    return path


def serve(path: Path, vendor: str | None) -> None:
    """Load the layer from `path`, run it, and compare with the float64 MoE of the checkpoint."""
    from safetensors import safe_open

    experts = ExpertCheckpointLoader("fp8-block128", E, H, I, local_experts=range(E))
    load_safetensors([path], PREFIX, experts)
    shared = ExpertCheckpointLoader("fp8-block128", 1, H, SHARED * I, local_experts=range(1))
    with safe_open(str(path), "pt") as f:  # the shared experts: one expert of SHARED * I channels
        for name in f.keys():
            if name.startswith(f"{PREFIX}.shared_experts."):
                shared.add(name.replace(".shared_experts.", ".experts.0."), f.get_tensor(name))
        gate = f.get_tensor(f"{PREFIX}.gate.weight")
        bias = f.get_tensor(f"{PREFIX}.gate.e_score_correction_bias")
    router = moe.GroupedTopK(
        E,
        TOP_K,
        num_groups=GROUPS,
        topk_groups=TOPK_GROUPS,
        scoring="sigmoid",
        group_score="top2-sum",
        correction_bias=bias,
        routed_scaling_factor=2.5,
    )
    layer = moe.MoELayer(
        H,
        I,
        E,
        TOP_K,
        scheme=experts.scheme(),
        vendor=vendor,
        router=router,
        shared_experts=moe.SharedExperts(SHARED * I),
    )
    layer.load_expert_weights(experts.build(device=layer.vendor.device))
    layer.load_shared_expert_weights(shared.build(device=layer.vendor.device))
    print(layer)

    x = torch.randn(512, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits = x.float() @ gate.t()
    device = layer.vendor.device
    y = layer(x.to(device), logits.to(device)).cpu()

    print("computing the float64 MoE of the dequantized checkpoint to compare with")
    routing = router(logits)
    ref = reference(x, routing, experts.build(), shared.build())
    error = float((y.double() - ref).norm() / ref.norm())
    print(f"tokens {x.shape[0]}: relative error against the float64 MoE of the checkpoint {error:.2e}")


def reference(
    x: torch.Tensor, routing: moe.Routing, routed: moe.ExpertWeights, shared: moe.ExpertWeights
) -> torch.Tensor:
    """The float64 MoE of dequantized weights (hal.reference's decoders)."""
    from hal.reference import weight_value

    w13, w2 = weight_value(routed.w13), weight_value(routed.w2)
    s13, s2 = weight_value(shared.w13)[0], weight_value(shared.w2)[0]

    def mlp(rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = rows @ a
        gate, up = h.chunk(2, dim=-1)
        return (gate * torch.sigmoid(gate) * up) @ b

    xd = x.double()
    out = mlp(xd, s13, s2)
    for t in range(x.shape[0]):
        for j in range(routing.top_k):
            e = int(routing.topk_ids[t, j])
            out[t] += float(routing.topk_weights[t, j]) * mlp(xd[t : t + 1], w13[e], w2[e])[0]
    return out


def main() -> None:
    """Parse the command line and serve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, help="a safetensors file in the synthetic layout")
    parser.add_argument("--vendor", default=None, help="hal vendor (default: the best available)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            print(f"writing a synthetic FP8 block-128 checkpoint ({E} experts, hidden {H}) to a temporary folder")
        path = args.checkpoint or write_synthetic(Path(tmp))
        print(f"loading {path.name} as stored (nothing dequantized) and building the layer")
        serve(path, args.vendor)


if __name__ == "__main__":
    main()
