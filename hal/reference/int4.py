"""Int4 in torch: per-token int4 activations, and the packing of int4 values eight per int32 word.

Value j of a word sits in bits 4j..4j+3, in two's complement; activations and per-channel
weights (along N) use the same packing. Symmetric: `scale = rowmax|x| / 7`, values
`round(x / scale)` (half to even) in [-7, 7].
"""

from __future__ import annotations

import torch

from hal import checks
from hal.dtypes import INT4_MAX, INT4_PER_WORD
from hal.errors import invalid
from hal.formats import PackedInt4Tensor
from hal.reference.quantize import refuse_non_finite, symmetric


def quantize_int4(x: torch.Tensor) -> PackedInt4Tensor:
    """Quantize float activations `[..., H]` to per-token int4, packed eight per int32 word.

    Symmetric: `scale = rowmax|x| / 7`, values `round(x / scale)` (half to even) clamped to
    [-7, 7]. H must be a multiple of 8; all-zero rows get scale 0 and data 0.
    """
    checks.float_rows("x", x)
    h = x.shape[-1]
    if h % INT4_PER_WORD:
        raise invalid("x", f"a last dimension that is a multiple of {INT4_PER_WORD} for int4", h)
    return encode_int4(x)


def encode_int4(x: torch.Tensor) -> PackedInt4Tensor:
    """`quantize_int4` of arguments already checked; refuses non-finite input."""
    refuse_non_finite("x", x)
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    values, scale = symmetric(xf, amax, amax.unsqueeze(-1), qmax=float(INT4_MAX), target=torch.int8, rounds=True)
    return PackedInt4Tensor(pack_int4(values), scale)


def dequantize_int4(q: PackedInt4Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Invert `quantize_int4`: `value * scale`, shape `[..., H]` in `out_dtype`."""
    if not isinstance(q, PackedInt4Tensor):
        raise invalid("q", "a PackedInt4Tensor", type(q).__name__)
    checks.out_dtype("out_dtype", out_dtype)
    return (unpack_int4(q.data).to(torch.float32) * q.scale.unsqueeze(-1)).to(out_dtype)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack integers in [-8, 7] `[..., 8m]` into int32 words `[..., m]` (value j in bits 4j..4j+3)."""
    if not isinstance(values, torch.Tensor):
        raise invalid("values", "a torch.Tensor", type(values).__name__)
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise invalid("values", "an integer tensor", values.dtype)
    if values.dim() < 1 or values.shape[-1] % INT4_PER_WORD:
        raise invalid("values", f"a last dimension that is a multiple of {INT4_PER_WORD}", tuple(values.shape))
    v = values.to(torch.int64)
    if v.numel() and bool(((v < -8) | (v > 7)).any()):
        raise invalid("values", "integers in [-8, 7]", (int(v.min()), int(v.max())))
    shifts = _nibble_shifts(v.device)
    nibbles = (v & 0xF).reshape(*v.shape[:-1], v.shape[-1] // INT4_PER_WORD, INT4_PER_WORD)
    words = (nibbles << shifts).sum(dim=-1)  # in [0, 2^32): the unsigned bit pattern
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """Unpack int32 words `[..., m]` into int8 values in [-8, 7] `[..., 8m]` (inverse of `pack_int4`)."""
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int32:
        given = words.dtype if isinstance(words, torch.Tensor) else type(words).__name__
        raise invalid("words", "an int32 tensor", given)
    if words.dim() < 1:
        raise invalid("words", "at least 1 dimension", tuple(words.shape))
    nibbles = (words.to(torch.int64).unsqueeze(-1) >> _nibble_shifts(words.device)) & 0xF
    signed = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return signed.reshape(*words.shape[:-1], words.shape[-1] * INT4_PER_WORD).to(torch.int8)


def _nibble_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 4 * INT4_PER_WORD, 4, dtype=torch.int64, device=device)
