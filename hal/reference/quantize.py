"""Reference quantization of activations into every dispatch dtype, driven by the dtype table.

One implementation per `hal.Codec`: a cast; symmetric quantization (`scale = amax / qmax`
over each scale group of the layout, values `x / scale` saturated at qmax, rounded half to
even for integer dtypes, cast by torch's round-to-nearest-even for float dtypes); and nvfp4's
e2m1 blocks (`hal.reference.e2m1`). A dtype added to `hal.DTYPES` with one of these codecs
quantizes here without a change. Everything is vectorized torch, so the same functions run
on CPU and accelerator tensors.
"""

from __future__ import annotations

import math

import torch

from hal import checks
from hal.dtypes import Codec, DispatchDtype, ScaleLayout
from hal.errors import invalid
from hal.finite import refuse_non_finite
from hal.formats import QuantizedTensor
from hal.reference import e2m1


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
    parsed = checks.concrete_dtype(dtype)
    spec = parsed.spec
    chosen = checks.activation_layout(layout, parsed, spec.default_layout)
    checks.float_rows("x", x)
    checks.global_scale_for(parsed, global_scale, x.device)
    spec.check_hidden("x", x.shape[-1], chosen)
    return encode(x, parsed, chosen, global_scale)


def encode(
    x: torch.Tensor, dtype: DispatchDtype, layout: ScaleLayout, global_scale: torch.Tensor | None
) -> QuantizedTensor:
    """`quantize` of arguments already checked (as `hal.Vendor.quantize` checks them); refuses
    non-finite input, which only reading the values shows."""
    refuse_non_finite("x", x)
    spec, parsed, chosen = dtype.spec, dtype, layout
    if spec.codec is Codec.CAST:
        return QuantizedTensor(x.to(spec.storage), parsed, chosen)
    xf = x.to(torch.float32)
    if spec.codec is Codec.E2M1_BLOCKS:
        gs = e2m1.tensor_scale(xf) if global_scale is None else e2m1.checked_scale(global_scale)
        packed, scale = e2m1.encode_blocks(xf, gs)
        return QuantizedTensor(packed, parsed, chosen, scale, gs.reshape(1))
    amax = group_amax(xf, chosen.group_size)
    data, scale = symmetric(
        xf,
        amax,
        expand_groups(amax, chosen.group_size, xf.shape[-1]),
        qmax=float(spec.qmax),
        target=spec.storage,
        rounds=spec.rounds,
    )  # type: ignore[arg-type]
    return QuantizedTensor(data, parsed, chosen, scale)


def dequantize(q: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Invert `quantize`: `data * scale` (nvfp4: `e2m1(code) * scale / global_scale`), shape `[..., H]`."""
    if not isinstance(q, QuantizedTensor):
        raise invalid("q", "a QuantizedTensor", type(q).__name__)
    checks.out_dtype("out_dtype", out_dtype)
    spec = q.dtype.spec
    if spec.codec is Codec.CAST:
        return q.data.to(out_dtype)
    if spec.codec is Codec.E2M1_BLOCKS:
        return e2m1.decode_blocks(q.data, q.scale, q.global_scale).to(out_dtype)  # type: ignore[arg-type]
    data = q.data.to(torch.float32)
    return (data * expand_groups(q.scale, q.layout.group_size, data.shape[-1])).to(out_dtype)  # type: ignore[arg-type]


# -- shared by activations and weights ------------------------------------------------------------


def symmetric(
    x: torch.Tensor, amax: torch.Tensor, amax_like_x: torch.Tensor, *, qmax: float, target: torch.dtype, rounds: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale fp32 `x` by `amax / qmax` (amax pre-broadcast to x as `amax_like_x`), round to integers
    when `rounds` (half to even), saturate at qmax and cast to `target`; return `(data, fp32 scale)`."""
    scale = amax / qmax
    step = amax_like_x / qmax
    # An all-zero row/group divides by 1 instead of 0; its data is 0 either way.
    q = x / torch.where(step == 0, torch.ones_like(step), step)
    if rounds:
        q = torch.round(q)
    # Saturate explicitly: older torch turned out-of-range float8 casts into NaN.
    return q.clamp(-qmax, qmax).to(target), scale.to(torch.float32)


def group_amax(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """Max |x| per row (`group` None: `[...]`) or per row and `group` channels (`[..., ceil(H/group)]`,
    the last group possibly partial)."""
    if group is None:
        return x.abs().amax(dim=-1)
    h = x.shape[-1]
    groups = math.ceil(h / group)
    padded = torch.nn.functional.pad(x.abs(), (0, groups * group - h))
    return padded.reshape(*x.shape[:-1], groups, group).amax(dim=-1)


def expand_groups(scale: torch.Tensor, group: int | None, h: int) -> torch.Tensor:
    """Broadcast per-row (`[...]`) or per-group (`[..., G]`) values over their channels, as `[..., H]`
    or `[..., 1]`."""
    if group is None:
        return scale.unsqueeze(-1)
    return scale.repeat_interleave(group, dim=-1)[..., :h]
