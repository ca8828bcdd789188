"""A small gpt-oss in its MXFP4 checkpoint layout: the experts' `*_blocks` / `*_scales` (plus biases) of a
transformers model, and the model's expert weights set to their MXFP4 values as transformers decodes them."""

from __future__ import annotations

import torch

from hal import reference

PROJECTIONS = ("gate_up_proj", "down_proj")


def expert_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The `GptOssExperts` modules of `model`, by module name."""
    return {name: m for name, m in model.named_modules() if type(m).__name__ == "GptOssExperts"}


@torch.no_grad()
def mxfp4_checkpoint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The expert tensors of `model` as gpt-oss stores them: per projection (weights `[E, K, N]`, gate/up
    interleaved along N) `<name>.<proj>_blocks` uint8 `[E, N, K/32, 16]` and `<name>.<proj>_scales` uint8
    `[E, N, K/32]`, and `<name>.<proj>_bias` `[E, N]`."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in expert_modules(model).items():
        for proj in PROJECTIONS:
            w = getattr(module, proj).float()
            e, k, n = w.shape
            q = reference.quantize_weight(w, "mxfp4")  # data [E, K/2, N], scale [E, K/32, N]
            tensors[f"{name}.{proj}_blocks"] = q.data.transpose(1, 2).reshape(e, n, k // 32, 16).contiguous()
            tensors[f"{name}.{proj}_scales"] = q.scale.transpose(1, 2).contiguous()
            tensors[f"{name}.{proj}_bias"] = getattr(module, f"{proj}_bias").detach().to(torch.bfloat16).clone()
    return tensors


@torch.no_grad()
def load_as_transformers_does(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`model` with its expert weights and biases replaced by the checkpoint's, decoded by transformers' own
    MXFP4 code (`transformers.integrations.mxfp4.convert_moe_packed_tensors`)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for name, module in expert_modules(model).items():
        for proj in PROJECTIONS:
            param = getattr(module, proj)
            blocks, scales = tensors[f"{name}.{proj}_blocks"], tensors[f"{name}.{proj}_scales"]
            param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).to(param.dtype))
            getattr(module, f"{proj}_bias").copy_(tensors[f"{name}.{proj}_bias"])
    return model
