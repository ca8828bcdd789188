"""Shared pieces of the torch_npu emulation: limits, error wording, argument checks, int4 packing.

Sources and numerics: see `vendors.ascend.emulation.torch_npu_ops`.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

import torch

SOC_PREFIXES = (("Ascend910_93", "A3"), ("Ascend910B", "A2"), ("Ascend950", "A5"))  # name prefix -> generation
HALF = (torch.float16, torch.bfloat16)
FLOAT = (torch.float16, torch.bfloat16, torch.float32)
FP8_MAX = MappingProxyType({torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0})  # largest finite
INT8_MAX = 127.0
INT4_MAX = 7.0
INT4_PER_WORD = 8
INNER_LIMIT = 65536  # A2/A3 bound on the last (memory-inner) dimension of GMM operands
MAX_LIST = 128
MAX_GROUPS_3D = 1024
GMM = "npu_grouped_matmul"
GMM_PAIRINGS = (
    "(fp16|bf16|fp32 x same dtype), (int8 x int8: bf16 scale -> bf16 output, fp32 scale -> fp16 output), "
    "(fp16|bf16 x int8|int32-packed int4 with antiquant_scale), (float8 x float8, A5 only)"
)


def err(op: str, message: str) -> RuntimeError:
    return RuntimeError(f"{op}: {message}")


def dtype_name(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else str(dtype).replace("torch.", "")


def tensor_arg(op: str, name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise err(op, f"{name} must be a tensor, got {type(value).__name__}")
    return value


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise err(op, f"{name} dtype must be one of [{names}], got {dtype_name(t.dtype)}")


def check_shape(op: str, name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise err(op, f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack integers in [-8, 7] along the last dim, 8 per int32: value j of each run of
    eight fills bits 4j..4j+3 as a two's-complement nibble (lowest nibble first)."""
    nibbles = (q.to(torch.int64) & 0xF).reshape(*q.shape[:-1], q.shape[-1] // INT4_PER_WORD, INT4_PER_WORD)
    shifts = torch.arange(0, 4 * INT4_PER_WORD, 4, device=q.device)
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 [..., n] -> int64 [..., 8n] with values in [-8, 7]."""
    shifts = torch.arange(0, 4 * INT4_PER_WORD, 4, device=words.device)
    nibbles = ((words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & 0xF
    signed = nibbles - 16 * (nibbles >= 8).to(torch.int64)
    return signed.reshape(*words.shape[:-1], words.shape[-1] * INT4_PER_WORD)


def expand_over_k(name: str, t: torch.Tensor, k: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A weight-only parameter as float32: [N] (per channel) or [G, N] (per group, G dividing K,
    each row repeated over K/G consecutive rows of the weight)."""
    check_dtype(GMM, name, t, (dtype,))
    if tuple(t.shape) == (n,):
        return t.to(torch.float32)
    if t.dim() == 2 and t.shape[1] == n and t.shape[0] > 0 and k % t.shape[0] == 0:
        return t.to(torch.float32).repeat_interleave(k // t.shape[0], dim=0)
    raise err(GMM, f"{name} per group must be [{n}] or [G, {n}] with G dividing K={k}, got {list(t.shape)}")


def quantize_rows(xf: torch.Tensor, dtype_max: float, target: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of float32 `xf` [..., H]: scale = rowmax|x| / max.

    assumption: an all-zero row gets scale 0 and data 0 (the division is guarded).
    Each row only reads itself, so a non-finite value cannot leak into other rows.
    """
    if xf.shape[-1] == 0:
        scale = xf.new_zeros(xf.shape[:-1])
    else:
        scale = xf.abs().amax(dim=-1) / dtype_max
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(-1)
    scaled = xf / divisor
    if target in FP8_MAX:
        return scaled.clamp(-dtype_max, dtype_max).to(target), scale
    q = torch.round(scaled).clamp(-dtype_max, dtype_max)
    if target == torch.quint4x2:
        return pack_int4(q), scale
    return q.to(torch.int8), scale
