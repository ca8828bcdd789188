"""Synthetic MoE checkpoints in each on-disk format, written here from each format's definition.

Nothing here calls `moe.checkpoint` or hal's quantizers: every encoder follows the format as
its producers document it (DeepSeek-V3 fp8 blocks, compressed-tensors fp8/int8, NVIDIA
ModelOpt NVFP4), and every decoder is its float64 definition. A `Synthetic` holds the
tensors as stored plus the float64 value of each projection, from which `expected` builds
the `[E, H, 2I]` / `[E, I, H]` reference of any rank's experts and intermediate shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FP8_MAX, INT8_MAX, E2M1_MAX = 448.0, 127.0, 6.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
SIGNED_E2M1 = torch.cat([E2M1, -E2M1])  # code c: bit 3 the sign, bits 0-2 the magnitude index
PROJECTIONS = ("gate", "up", "down")


# -- encoders: float64 [N, K] -> the stored tensors of one projection, and their float64 value ----------------


def encode_float(w: torch.Tensor, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    stored = w.to(dtype)
    return {"weight": stored}, stored.double()


def encode_fp8_block(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """DeepSeek-V3: one fp32 `weight_scale_inv` per 128x128 tile (amax / 448), `w = q * scale_inv`."""
    n, k = w.shape
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    scale = torch.ones(nb, kb, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            amax = float(w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max())
            scale[i, j] = amax / FP8_MAX if amax > 0 else 1.0
    full = scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.double() * full


def encode_fp8(
    w: torch.Tensor, per_channel: bool, scale_shape: tuple[int, ...] | None = None, input_scale: float | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors / AutoFP8: `weight_scale` per tensor (`[]`) or per channel (`[N]` / `[N, 1]`)."""
    amax = w.abs().amax(dim=1) if per_channel else w.abs().max().reshape(())
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0).to(torch.float32)
    step = scale.double().reshape(-1, 1) if per_channel else scale.double()
    q = (w / step).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    stored = {"weight": q, "weight_scale": scale.reshape(scale_shape) if scale_shape is not None else scale}
    if input_scale is not None:
        stored["input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
    return stored, q.double() * step


def encode_int8(
    w: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """W8A8-INT8 (compressed-tensors): per-channel `weight_scale` `[N, 1]`, `q = round(w / scale)`."""
    scale = torch.where(w.abs().amax(dim=1) > 0, w.abs().amax(dim=1) / INT8_MAX, 1.0).to(scale_dtype)
    step = scale.double().reshape(-1, 1)
    q = torch.round(w / step).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return {"weight": q, "weight_scale": scale.reshape(-1, 1)}, q.double() * step


def encode_nvfp4(
    w: torch.Tensor, input_scale: float, weight_scale_2: float | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """NVIDIA ModelOpt NVFP4: `weight_scale_2 = amax / (448 * 6)`, e4m3 `weight_scale` per 16 values
    along K (`block_amax / 6 / weight_scale_2`), e2m1 codes two per byte along K, the even k in the
    low nibble; `w = e2m1 * weight_scale * weight_scale_2`."""
    n, k = w.shape
    ws2 = float(w.abs().max()) / (FP8_MAX * E2M1_MAX) if weight_scale_2 is None else weight_scale_2
    ws2 = float(torch.tensor(ws2, dtype=torch.float32))
    blocks = w.reshape(n, k // 16, 16)
    block_scale = (blocks.abs().amax(dim=-1) / E2M1_MAX / ws2).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    step = block_scale.double().unsqueeze(-1) * ws2
    ratio = torch.where(step > 0, blocks / torch.where(step > 0, step, 1.0), 0.0)
    codes = (ratio.unsqueeze(-1) - SIGNED_E2M1).abs().argmin(dim=-1).reshape(n, k)  # nearest e2m1 code
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    value = (SIGNED_E2M1[codes].reshape(n, k // 16, 16) * step).reshape(n, k)
    stored = {
        "weight": packed,
        "weight_scale": block_scale,
        "weight_scale_2": torch.tensor(ws2, dtype=torch.float32),
        "input_scale": torch.tensor(input_scale, dtype=torch.float32),
    }
    return stored, value


def decode_nvfp4(stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float64 value of ModelOpt NVFP4 tensors, nibble by nibble (a check of `encode_nvfp4`)."""
    packed = stored["weight"].long()
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    scale = stored["weight_scale"].double().repeat_interleave(16, dim=1)
    return SIGNED_E2M1[codes] * scale * float(stored["weight_scale_2"])


# -- a layer's checkpoint ------------------------------------------------------------------------------------


@dataclass
class Synthetic:
    """A layer's stored tensors (`tensors`) and the float64 value of each (expert, projection) `[N, K]`."""

    hidden: int
    intermediate: int
    num_experts: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    biases: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    input_scales: dict[tuple[int, str], float] = field(default_factory=dict)

    def expected(
        self, experts: range, tp_rank: int = 0, tp_size: int = 1, gated: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 `w13` `[E, H, 2I/tp]` (`[gate | up]`) and `w2` `[E, I/tp, H]` of a rank."""
        size = self.intermediate // tp_size
        rows = slice(tp_rank * size, (tp_rank + 1) * size)
        firsts = ("gate", "up") if gated else ("up",)
        w13 = torch.stack([torch.cat([self.values[(e, p)][rows].T for p in firsts], dim=1) for e in experts])
        w2 = torch.stack([self.values[(e, "down")][:, rows].T for e in experts])
        return w13, w2

    def expected_biases(self, experts: range, tp_rank: int = 0, tp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.intermediate // tp_size
        rows = slice(tp_rank * size, (tp_rank + 1) * size)
        b13 = torch.stack([torch.cat([self.biases[(e, p)][rows] for p in ("gate", "up")]) for e in experts])
        b2 = torch.stack([self.biases[(e, "down")] for e in experts])
        return b13.double(), (b2 if tp_rank == 0 else torch.zeros_like(b2)).double()


def master(shape: tuple[int, ...], seed: int, scale: float = 0.05) -> torch.Tensor:
    """Random float64 master weights (a few outliers, as trained weights have)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    return w * torch.where(torch.rand(*shape, generator=g, dtype=torch.float64) < 0.01, 8.0, 1.0)


HF = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}


def per_expert(
    encode,
    hidden: int,
    intermediate: int,
    num_experts: int,
    prefix: str,
    *,
    seed: int = 0,
    names: dict[str, str] = HF,
    bias: bool = False,
    gated: bool = True,
) -> Synthetic:
    """A checkpoint with one tensor per (expert, projection, kind); `encode(w, expert, projection)`
    returns the stored tensors of one projection and their float64 value."""
    out = Synthetic(hidden, intermediate, num_experts)
    for e in range(num_experts):
        for p in PROJECTIONS if gated else ("up", "down"):
            n, k = (hidden, intermediate) if p == "down" else (intermediate, hidden)
            stored, value = encode(master((n, k), seed * 7919 + e * 3 + PROJECTIONS.index(p)), e, p)
            out.values[(e, p)] = value
            for kind, t in stored.items():
                out.tensors[f"{prefix}.experts.{e}.{names[p]}.{kind}"] = t
                if kind == "input_scale":
                    out.input_scales[(e, p)] = float(t)
            if bias:
                b = master((n,), seed * 104729 + e * 3 + PROJECTIONS.index(p), scale=0.5).to(torch.bfloat16)
                out.biases[(e, p)] = b
                out.tensors[f"{prefix}.experts.{e}.{names[p]}.bias"] = b
    return out


def fused_checkpoint(
    num_experts: int,
    hidden: int,
    intermediate: int,
    layout: str = "out-in",
    bias: bool = False,
    prefix: str = "model.layers.0.mlp",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Synthetic, dict[str, torch.Tensor]]:
    """Float experts stored as transformers' fused all-experts tensors: `out-in` (Qwen3-MoE, Mixtral:
    `gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`), `in-out` (Llama-4: `[E, H, 2I]`, `[E, I, H]`)
    or `gpt-oss` (in-out with gate and up interleaved: column 2j is gate j, 2j + 1 is up j)."""
    ckpt = per_expert(
        lambda w, e, p: encode_float(w, dtype), hidden, intermediate, num_experts, prefix, bias=bias, seed=17
    )
    gate = torch.stack([ckpt.values[(e, "gate")] for e in range(num_experts)]).to(dtype)  # [E, I, H]
    up = torch.stack([ckpt.values[(e, "up")] for e in range(num_experts)]).to(dtype)
    down = torch.stack([ckpt.values[(e, "down")] for e in range(num_experts)]).to(dtype)  # [E, H, I]
    if layout == "gpt-oss":
        gate_up = torch.stack([gate, up], dim=2).reshape(num_experts, 2 * intermediate, hidden)  # rows alternate
    else:
        gate_up = torch.cat([gate, up], dim=1)  # [E, 2I, H]
    if layout == "out-in":
        tensors = {f"{prefix}.experts.gate_up_proj": gate_up, f"{prefix}.experts.down_proj": down}
    else:
        tensors = {
            f"{prefix}.experts.gate_up_proj": gate_up.transpose(1, 2).contiguous(),
            f"{prefix}.experts.down_proj": down.transpose(1, 2).contiguous(),
        }
    if bias:
        bg = torch.stack([ckpt.biases[(e, "gate")] for e in range(num_experts)])
        bu = torch.stack([ckpt.biases[(e, "up")] for e in range(num_experts)])
        pair = torch.stack([bg, bu], dim=2).reshape(num_experts, -1) if layout == "gpt-oss" else torch.cat([bg, bu], 1)
        tensors[f"{prefix}.experts.gate_up_proj_bias"] = pair
        tensors[f"{prefix}.experts.down_proj_bias"] = torch.stack(
            [ckpt.biases[(e, "down")] for e in range(num_experts)]
        )
    return ckpt, tensors
