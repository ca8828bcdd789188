"""Reference quantizers for activations and expert weights, in device-agnostic torch.

The layouts are the ones `hal.formats` documents. Everything is vectorized: the same
functions run on CPU and accelerator tensors. Rounding is torch's: `torch.round` (half
to even) for int8 and int4, the float8 cast (round to nearest even) for e4m3, and an
explicit nearest-even-code rule for nvfp4's e2m1 values.
"""

from __future__ import annotations

import math

import torch

from hal.dtypes import FP8_GROUP_SIZE, NVFP4_BLOCK_SIZE, DispatchDtype, ScaleLayout
from hal.errors import InvalidInput, invalid
from hal.formats import (
    FLOAT_DTYPES,
    INT4_MAX,
    INT4_PER_WORD,
    PackedInt4Tensor,
    QuantizedTensor,
    QuantizedWeight,
)

INT8_MAX = 127.0
FP8_MAX = 448.0  #: largest finite float8_e4m3fn
FP4_MAX = 6.0  #: largest e2m1 magnitude

#: e2m1 magnitude of each 3-bit code (exponent << 1 | mantissa); bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Midpoint between code i and i+1, and whether a tie there goes up (the even code is i+1).
_E2M1_MIDPOINTS = tuple(
    ((a + b) / 2, (i + 1) % 2 == 0) for i, (a, b) in enumerate(zip(E2M1_VALUES, E2M1_VALUES[1:]))
)


def quantize(
    x: torch.Tensor,
    dtype: DispatchDtype | str,
    layout: ScaleLayout | str | None = None,
    global_scale: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize float activations `[..., H]` into a dispatch dtype (see `hal.formats`).

    bf16 is a plain cast; int8 is per-token symmetric; fp8 e4m3 is per-token or per
    128-channel group; nvfp4 uses 16-value e4m3 block scales under an fp32 global scale
    (default `448 * 6 / amax(|x|)`). All-zero rows, groups and blocks get scale 0 and
    data 0. Non-finite input is rejected.
    """
    dtype = _parse_dtype(dtype)
    layout = _parse_layout(layout, dtype)
    _check_float_input("x", x)
    if global_scale is not None and dtype is not DispatchDtype.NVFP4:
        raise invalid("global_scale", f"None for {dtype} (only nvfp4 has a global scale)", "a tensor")
    if dtype is DispatchDtype.BF16:
        return QuantizedTensor(x.to(torch.bfloat16), dtype, layout)
    xf = x.to(torch.float32)
    if dtype is DispatchDtype.INT8:
        amax = xf.abs().amax(dim=-1)
        data, scale = _symmetric(xf, amax, INT8_MAX, torch.int8, amax.unsqueeze(-1))
        return QuantizedTensor(data, dtype, layout, scale)
    if dtype is DispatchDtype.FP8:
        if layout is ScaleLayout.PER_TOKEN:
            amax = xf.abs().amax(dim=-1)
            data, scale = _symmetric(xf, amax, FP8_MAX, torch.float8_e4m3fn, amax.unsqueeze(-1))
        else:
            amax = _group_amax(xf)
            expanded = _expand_groups(amax, xf.shape[-1])
            data, scale = _symmetric(xf, amax, FP8_MAX, torch.float8_e4m3fn, expanded)
        return QuantizedTensor(data, dtype, layout, scale)
    return _quantize_nvfp4(xf, global_scale)


def dequantize(q: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Invert `quantize`: `data * scale` (nvfp4: `e2m1(code) * scale / global_scale`), shape `[..., H]`."""
    if not isinstance(q, QuantizedTensor):
        raise invalid("q", "a QuantizedTensor", type(q).__name__)
    _check_out_dtype("out_dtype", out_dtype)
    if q.dtype is DispatchDtype.BF16:
        return q.data.to(out_dtype)
    if q.dtype is DispatchDtype.NVFP4:
        values = _decode_e2m1(q.data)
        scale = q.scale.to(torch.float32).repeat_interleave(NVFP4_BLOCK_SIZE, dim=-1)
        return (values * scale / q.global_scale.to(torch.float32).reshape(())).to(out_dtype)
    data = q.data.to(torch.float32)
    if q.layout is ScaleLayout.PER_TOKEN:
        scale = q.scale.unsqueeze(-1)
    else:
        scale = _expand_groups(q.scale, data.shape[-1])
    return (data * scale).to(out_dtype)


def quantize_weight(
    w: torch.Tensor, layout: ScaleLayout | str, dtype: torch.dtype | None = None
) -> QuantizedWeight:
    """Quantize float expert weights `[E, K, N]`.

    none: cast to `dtype` (default `w.dtype`); per-channel: int8 (default), fp8 or int4
    (`torch.quint4x2`: values in [-7, 7] packed eight per int32 along N) with
    `scale[e, n] = max_k |w[e, k, n]| / qmax`; block-128x128: fp8 with one scale per
    (partial) 128x128 tile of each expert; block-16: nvfp4 (uint8, two e2m1 codes along K)
    with an e4m3 scale per 16 k and n, under a per-expert fp32 global scale
    `448 * 6 / amax(|w[e]|)`. Zero channels, tiles and blocks get scale 0, data 0.
    """
    layout = _parse_weight_layout(layout)
    # Errors name `weight`, the argument of the `Vendor.quantize_weight` op.
    _check_float_input("weight", w)
    if w.dim() != 3 or w.shape[1] == 0:
        raise invalid("weight", "3 dimensions [experts, K, N] with K > 0 and N > 0", tuple(w.shape))
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise invalid("dtype", "a torch.dtype or None", dtype)
    if layout is ScaleLayout.NONE:
        target = w.dtype if dtype is None else dtype
        if target not in FLOAT_DTYPES:
            raise invalid("dtype", "bf16, fp16 or fp32 for unscaled weights", target)
        return QuantizedWeight(w.to(target), layout)
    wf = w.to(torch.float32)
    if layout is ScaleLayout.PER_CHANNEL:
        target = torch.int8 if dtype is None else dtype
        if target not in (torch.int8, torch.float8_e4m3fn, torch.quint4x2):
            raise invalid(
                "dtype",
                "torch.int8, torch.float8_e4m3fn or torch.quint4x2 (int4) for per-channel weights",
                target,
            )
        if target == torch.quint4x2 and wf.shape[2] % INT4_PER_WORD:
            raise invalid(
                "weight", f"N a multiple of {INT4_PER_WORD} for int4 per-channel weights", tuple(w.shape)
            )
        amax = wf.abs().amax(dim=1)  # [E, N]
        if target == torch.quint4x2:
            values, scale = _symmetric(wf, amax, float(INT4_MAX), torch.int8, amax.unsqueeze(1))
            return QuantizedWeight(pack_int4(values), layout, scale)
        qmax = INT8_MAX if target == torch.int8 else FP8_MAX
        data, scale = _symmetric(wf, amax, qmax, target, amax.unsqueeze(1))
        return QuantizedWeight(data, layout, scale)
    if layout is ScaleLayout.BLOCK_16:
        if dtype is not None and dtype != torch.uint8:
            raise invalid("dtype", "None or torch.uint8 (packed e2m1) for block-16 (nvfp4) weights", dtype)
        return _quantize_nvfp4_weight(wf)
    target = torch.float8_e4m3fn if dtype is None else dtype
    if target != torch.float8_e4m3fn:
        raise invalid("dtype", "torch.float8_e4m3fn for block-128x128 weights", target)
    amax = _tile_amax(wf)
    expanded = _expand_tiles(amax, wf.shape[1], wf.shape[2])
    data, scale = _symmetric(wf, amax, FP8_MAX, target, expanded)
    return QuantizedWeight(data, layout, scale)


def dequantize_weight(weight: QuantizedWeight) -> torch.Tensor:
    """Invert `quantize_weight`: fp32 `[E, K, N]` (`data * scale`; nvfp4: `e2m1 * scale / global_scale[e]`)."""
    if not isinstance(weight, QuantizedWeight):
        raise invalid("weight", "a QuantizedWeight", type(weight).__name__)
    if weight.layout is ScaleLayout.NONE:
        return weight.data.to(torch.float32)
    scale = weight.scale.to(torch.float32)  # type: ignore[union-attr]
    if weight.layout is ScaleLayout.PER_CHANNEL:
        data = unpack_int4(weight.data) if weight.is_int4 else weight.data
        return data.to(torch.float32) * scale.unsqueeze(1)
    if weight.layout is ScaleLayout.BLOCK_128X128:
        _, k, n = weight.data.shape
        return weight.data.to(torch.float32) * _expand_tiles(scale, k, n)
    values = _decode_e2m1(weight.data, dim=1)  # [E, K, N]
    gs = weight.global_scale.to(torch.float32).reshape(-1, 1, 1)  # type: ignore[union-attr]
    return values * scale.repeat_interleave(NVFP4_BLOCK_SIZE, dim=1) / gs


# -- int4 ------------------------------------------------------------------------------------------


def quantize_int4(x: torch.Tensor) -> PackedInt4Tensor:
    """Quantize float activations `[..., H]` to per-token int4, packed eight per int32 word.

    Symmetric: `scale = rowmax|x| / 7`, values `round(x / scale)` (half to even) clamped to
    [-7, 7]. H must be a multiple of 8; all-zero rows get scale 0 and data 0.
    """
    _check_float_input("x", x)
    h = x.shape[-1]
    if h % INT4_PER_WORD:
        raise invalid("x", f"a last dimension that is a multiple of {INT4_PER_WORD} for int4", h)
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    values, scale = _symmetric(xf, amax, float(INT4_MAX), torch.int8, amax.unsqueeze(-1))
    return PackedInt4Tensor(pack_int4(values), scale)


def dequantize_int4(q: PackedInt4Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Invert `quantize_int4`: `value * scale`, shape `[..., H]` in `out_dtype`."""
    if not isinstance(q, PackedInt4Tensor):
        raise invalid("q", "a PackedInt4Tensor", type(q).__name__)
    _check_out_dtype("out_dtype", out_dtype)
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


# -- shared helpers --------------------------------------------------------------------------------


def _symmetric(
    x: torch.Tensor, amax: torch.Tensor, qmax: float, target: torch.dtype, amax_like_x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale `x` by `amax / qmax` (amax pre-broadcast to x as `amax_like_x`), saturate, cast."""
    scale = amax / qmax
    step = amax_like_x / qmax
    # An all-zero row/group divides by 1 instead of 0; its data is 0 either way.
    q = x / torch.where(step == 0, torch.ones_like(step), step)
    if target == torch.int8:
        q = torch.round(q)
    # Saturate explicitly: older torch turned out-of-range float8 casts into NaN.
    q = q.clamp(-qmax, qmax).to(target)
    return q, scale.to(torch.float32)


def _group_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-row, per-128-channel max |x|: `[..., H] -> [..., ceil(H/128)]` (last group may be partial)."""
    h = x.shape[-1]
    groups = math.ceil(h / FP8_GROUP_SIZE)
    padded = torch.nn.functional.pad(x.abs(), (0, groups * FP8_GROUP_SIZE - h))
    return padded.reshape(*x.shape[:-1], groups, FP8_GROUP_SIZE).amax(dim=-1)


def _expand_groups(scale: torch.Tensor, h: int) -> torch.Tensor:
    """Broadcast `[..., G]` group scales over their channels: `[..., H]`."""
    return scale.repeat_interleave(FP8_GROUP_SIZE, dim=-1)[..., :h]


def _tile_amax(w: torch.Tensor) -> torch.Tensor:
    """Max |w| per expert and (partial) 128x128 tile: `[E, K, N] -> [E, ceil(K/128), ceil(N/128)]`."""
    e, k, n = w.shape
    kb, nb = math.ceil(k / FP8_GROUP_SIZE), math.ceil(n / FP8_GROUP_SIZE)
    padded = torch.nn.functional.pad(w.abs(), (0, nb * FP8_GROUP_SIZE - n, 0, kb * FP8_GROUP_SIZE - k))
    return padded.reshape(e, kb, FP8_GROUP_SIZE, nb, FP8_GROUP_SIZE).amax(dim=(2, 4))


def _expand_tiles(scale: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """Broadcast `[E, Kb, Nb]` tile scales over their elements: `[E, K, N]`."""
    return (
        scale.repeat_interleave(FP8_GROUP_SIZE, dim=-2)
        .repeat_interleave(FP8_GROUP_SIZE, dim=-1)[..., :k, :n]
    )


# -- nvfp4 -----------------------------------------------------------------------------------------


def _quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None) -> QuantizedTensor:
    h = x.shape[-1]
    if h % NVFP4_BLOCK_SIZE:
        raise invalid("x", f"a last dimension that is a multiple of {NVFP4_BLOCK_SIZE} for nvfp4", h)
    gs = _nvfp4_global_scale(x) if global_scale is None else _check_global_scale(global_scale, x)
    packed, scale = _encode_nvfp4_blocks(x, gs)
    return QuantizedTensor(packed, DispatchDtype.NVFP4, ScaleLayout.BLOCK_16, scale, gs.reshape(1))


def _quantize_nvfp4_weight(w: torch.Tensor) -> QuantizedWeight:
    """nvfp4 weights `[E, K, N]`: blocks of 16 along K, one global scale per expert."""
    e, k, n = w.shape
    if k % NVFP4_BLOCK_SIZE:
        raise invalid("weight", f"K a multiple of {NVFP4_BLOCK_SIZE} for block-16 (nvfp4) weights", tuple(w.shape))
    amax = w.abs().amax(dim=(1, 2)) if w.numel() else w.new_zeros(e)
    gs = _nvfp4_scale_from_amax(amax)
    # Move K last, so that blocks and packing run along the last dimension as for activations.
    packed, scale = _encode_nvfp4_blocks(w.transpose(1, 2), gs.reshape(e, 1, 1))
    return QuantizedWeight(
        packed.transpose(1, 2).contiguous(), ScaleLayout.BLOCK_16, scale.transpose(1, 2).contiguous(), gs
    )


def _encode_nvfp4_blocks(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 16 along the last dimension of fp32 `x` `[..., H]`: packed codes `[..., H/2]` and
    e4m3 block scales `[..., H/16]`; `gs` broadcasts against the block scales."""
    h = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], h // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1)
    scale = (block_amax / FP4_MAX * gs).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    step = (scale.to(torch.float32) / gs).unsqueeze(-1)
    usable = step > 0  # blocks whose scale is 0 (or underflows) get code 0
    ratio = blocks / torch.where(usable, step, torch.ones_like(step))
    codes = torch.where(usable, _encode_e2m1(ratio), torch.zeros_like(ratio, dtype=torch.uint8))
    codes = codes.reshape(*x.shape[:-1], h // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), scale


def _nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """`448 * 6 / amax(|x|)` as an fp32 scalar tensor; 1 for an all-zero (or empty) tensor."""
    if x.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=x.device)
    return _nvfp4_scale_from_amax(x.abs().amax())


def _nvfp4_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """`448 * 6 / amax` elementwise in fp32; 1 where amax is 0."""
    amax = amax.to(torch.float64)
    gs = torch.where(amax > 0, FP8_MAX * FP4_MAX / amax, torch.ones_like(amax))
    # A subnormal amax would overflow fp32; the largest finite scale keeps everything finite.
    return gs.clamp(max=torch.finfo(torch.float32).max).to(torch.float32)


def _check_global_scale(global_scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(global_scale, torch.Tensor) or global_scale.numel() != 1:
        shape = tuple(global_scale.shape) if isinstance(global_scale, torch.Tensor) else global_scale
        raise invalid("global_scale", "a one-element fp32 tensor or None", shape)
    if global_scale.dtype != torch.float32:
        raise invalid("global_scale", "dtype torch.float32", global_scale.dtype)
    if global_scale.device != x.device:
        raise invalid("global_scale", f"a tensor on {x.device} (the device of x)", str(global_scale.device))
    gs = global_scale.reshape(())
    if not bool(torch.isfinite(gs) & (gs > 0)):
        raise invalid("global_scale", "a finite positive value", float(gs))
    return gs


def _encode_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even code, saturating at 6): 4-bit codes, uint8."""
    mag = v.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for midpoint, tie_up in _E2M1_MIDPOINTS:
        code += (mag >= midpoint if tie_up else mag > midpoint).to(torch.uint8)
    sign = ((v < 0) & (code > 0)).to(torch.uint8) << 3  # zero is always code 0, never -0
    return code | sign


def _decode_e2m1(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Unpack uint8 codes (two per byte, low nibble first, along `dim`) into fp32 e2m1 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    table = torch.cat([table, -table])
    last = packed.movedim(dim, -1)
    codes = torch.stack([last & 0xF, last >> 4], dim=-1)
    codes = codes.reshape(*last.shape[:-1], last.shape[-1] * 2)
    return table[codes.long()].movedim(-1, dim)


# -- validation ------------------------------------------------------------------------------------


def _parse_dtype(dtype: DispatchDtype | str) -> DispatchDtype:
    parsed = DispatchDtype.parse(dtype)
    if parsed is DispatchDtype.AUTO:
        raise invalid("dtype", "a concrete dispatch dtype (bf16, fp8, int8, nvfp4)", "auto")
    return parsed


def _parse_layout(layout: ScaleLayout | str | None, dtype: DispatchDtype) -> ScaleLayout:
    allowed = ", ".join(map(str, dtype.scale_layouts()))
    if layout is None:
        return dtype.default_scale_layout
    try:
        parsed = ScaleLayout(layout)
    except ValueError:
        raise invalid("layout", f"one of {allowed} for {dtype}", layout) from None
    if parsed not in dtype.scale_layouts():
        raise invalid("layout", f"one of {allowed} for {dtype}", parsed.value)
    return parsed


def _parse_weight_layout(layout: ScaleLayout | str) -> ScaleLayout:
    allowed = (ScaleLayout.NONE, ScaleLayout.PER_CHANNEL, ScaleLayout.BLOCK_128X128, ScaleLayout.BLOCK_16)
    expected = "one of " + ", ".join(map(str, allowed))
    try:
        parsed = ScaleLayout(layout)
    except ValueError:
        raise invalid("layout", expected, layout) from None
    if parsed not in allowed:
        raise invalid("layout", expected, parsed.value)
    return parsed


def _check_float_input(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise invalid(name, "a torch.Tensor", type(x).__name__)
    if x.dtype not in FLOAT_DTYPES:
        raise invalid(name, "a bf16, fp16 or fp32 tensor", x.dtype)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise invalid(name, "at least one dimension and a non-empty last dimension", tuple(x.shape))
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise InvalidInput(f"{name}: expected finite values, got {bad} non-finite (inf/NaN) value(s)")


def _check_out_dtype(name: str, out_dtype: torch.dtype) -> None:
    if out_dtype not in FLOAT_DTYPES:
        raise invalid(name, "torch.bfloat16, torch.float16 or torch.float32", out_dtype)
