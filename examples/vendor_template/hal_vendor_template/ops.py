"""The template vendor's ops, in plain torch on the CPU.

These are the functions a real vendor replaces with calls into its kernels. The
formats are hal's (see `hal.formats`): bf16 activations are a plain cast; int8
activations are per-token symmetric, `scale = rowmax(|x|) / 127` in fp32 with shape
`x.shape[:-1]`; int8 weights `[E, K, N]` are per output channel, `scale[e, n] =
max_k |w[e, k, n]| / 127` in fp32 `[E, N]`. Every op validates its input and raises a
`hal.HalError` subclass: `InvalidInput` for a wrong argument, `UnsupportedCapability`
for something hal defines but this vendor does not do.
"""

from __future__ import annotations

import torch

import hal
from hal.errors import invalid, names

#: Activation and unscaled-weight dtypes the ops accept.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FLOAT_NAMES = "torch.bfloat16, torch.float16 or torch.float32"

INT8_MAX = 127.0

#: What the code below implements; the capability table must not declare more.
_QUANTIZE_DTYPES = (hal.DispatchDtype.BF16, hal.DispatchDtype.INT8)
_FLOAT_KINDS = (hal.GemmKind.BF16, hal.GemmKind.FP16, hal.GemmKind.FP32)

#: Weight layouts hal defines; the template implements none and per-channel (int8) only.
_WEIGHT_LAYOUTS = (hal.ScaleLayout.NONE, hal.ScaleLayout.PER_CHANNEL,
                   hal.ScaleLayout.BLOCK_128X128, hal.ScaleLayout.BLOCK_16)
#: Per-channel weight dtypes hal defines (int4 is spelled `torch.quint4x2`).
_PER_CHANNEL_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.quint4x2)


# -- activations -----------------------------------------------------------------------------------


def quantize(
    x: torch.Tensor,
    dtype: hal.DispatchDtype | str,
    *,
    layout: hal.ScaleLayout | str | None = None,
    global_scale: torch.Tensor | None = None,
    vendor: str,
    capabilities: hal.Capabilities,
) -> hal.QuantizedTensor:
    """Quantize float activations `[..., H]` to bf16 (a cast) or int8 per-token.

    int8 rounds half to even and saturates at ±127; an all-zero row gets scale 0 and
    data 0. `vendor` and `capabilities` only word the error for an unsupported dtype.
    """
    parsed = hal.DispatchDtype.parse(dtype)  # InvalidInput for an unknown name
    if parsed not in _QUANTIZE_DTYPES or parsed not in capabilities.dispatch_dtypes:
        hint = " (resolve 'auto' with hal.resolve_dispatch_plan first)" if parsed is hal.DispatchDtype.AUTO else ""
        raise hal.UnsupportedCapability(
            f"dtype: vendor {vendor!r} cannot quantize to {parsed}; its dispatch dtypes are "
            f"{names(capabilities.dispatch_dtypes)}{hint}"
        )
    layout = _activation_layout(layout, parsed)
    if global_scale is not None:
        raise invalid("global_scale", f"None for {parsed} (only nvfp4 has a global scale)", "a tensor")
    _check_activations("x", x)
    if parsed is hal.DispatchDtype.BF16:
        return hal.QuantizedTensor(x.to(torch.bfloat16), parsed, layout)
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / INT8_MAX  # [...]: one scale per token
    data = torch.round(xf / _nonzero(scale).unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return hal.QuantizedTensor(data, parsed, layout, scale)


def dequantize(q: hal.QuantizedTensor, out_dtype: torch.dtype = torch.float32, *, vendor: str) -> torch.Tensor:
    """Invert `quantize`: `data * scale` (bf16: a cast), `[..., H]` in `out_dtype`.

    `vendor` only words the error for a dtype the template does not handle.
    """
    if not isinstance(q, hal.QuantizedTensor):
        raise invalid("q", "a hal.QuantizedTensor", type(q).__name__)
    if q.dtype not in _QUANTIZE_DTYPES:
        raise hal.UnsupportedCapability(
            f"vendor {vendor!r} cannot dequantize {q.dtype} activations "
            f"(it handles {names(_QUANTIZE_DTYPES)})"
        )
    _check_out_dtype(out_dtype)
    if q.dtype is hal.DispatchDtype.BF16:
        return q.data.to(out_dtype)
    return (q.data.to(torch.float32) * q.scale.unsqueeze(-1)).to(out_dtype)


# -- weights ---------------------------------------------------------------------------------------


def quantize_weight(
    weight: torch.Tensor,
    layout: hal.ScaleLayout | str,
    dtype: torch.dtype | None = None,
    *,
    vendor: str,
) -> hal.QuantizedWeight:
    """Float expert weights `[E, K, N]` to unscaled float (`layout` none) or int8 per-channel.

    none casts to `dtype` (default: the weight's dtype); per-channel takes `dtype` None
    or `torch.int8`; a zero channel gets scale 0. Layouts and dtypes hal defines but
    the template lacks (fp8, int4, block scales, nvfp4) raise `UnsupportedCapability`,
    worded with `vendor`.
    """
    parsed = _layout_in(layout, _WEIGHT_LAYOUTS, f"a weight layout ({names(_WEIGHT_LAYOUTS)})")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise invalid("dtype", "a torch.dtype or None", dtype)
    if parsed not in (hal.ScaleLayout.NONE, hal.ScaleLayout.PER_CHANNEL):
        raise hal.UnsupportedCapability(
            f"vendor {vendor!r} cannot quantize weights to {parsed} (it supports none and per-channel int8)"
        )
    if not isinstance(weight, torch.Tensor):
        raise invalid("weight", "a torch.Tensor", type(weight).__name__)
    if weight.dtype not in FLOAT_DTYPES:
        raise invalid("weight", f"a {_FLOAT_NAMES} tensor", weight.dtype)
    if weight.dim() != 3 or weight.shape[1] == 0:
        raise invalid("weight", "3 dimensions [experts, K, N] with K > 0", tuple(weight.shape))
    _check_finite("weight", weight)

    if parsed is hal.ScaleLayout.NONE:
        target = weight.dtype if dtype is None else dtype
        if target not in FLOAT_DTYPES:
            raise invalid("dtype", f"{_FLOAT_NAMES} for unscaled weights", target)
        return hal.QuantizedWeight(weight.to(target), parsed)

    target = torch.int8 if dtype is None else dtype
    if target != torch.int8:
        if target in _PER_CHANNEL_DTYPES:
            raise hal.UnsupportedCapability(
                f"vendor {vendor!r} cannot quantize per-channel weights to {target} (it supports torch.int8)"
            )
        raise invalid("dtype", "None or torch.int8 for per-channel weights", target)
    wf = weight.to(torch.float32)
    scale = wf.abs().amax(dim=1) / INT8_MAX  # [E, N]: one scale per expert and output channel
    data = torch.round(wf / _nonzero(scale).unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return hal.QuantizedWeight(data, parsed, scale)


# -- grouped matmul --------------------------------------------------------------------------------


def grouped_matmul(
    x: torch.Tensor | hal.QuantizedTensor | hal.PackedInt4Tensor,
    weight: hal.QuantizedWeight,
    groups: hal.Groups,
    *,
    out_dtype: torch.dtype | None = None,
    vendor: str,
    capabilities: hal.Capabilities,
) -> torch.Tensor:
    """`y[rows of g] = x[rows of g] @ weight[g]` for every group g, scales applied: `[M, N]`.

    Float kinds multiply in fp32; the int8 kind computes the integer product exactly (in
    float64, exact for any realistic K) and then applies both scales. `out_dtype`
    defaults to the activation dtype for float kinds and bf16 for int8. The kind must
    be declared in `capabilities`, and its kernel limits hold.
    """
    # Accept every activation format hal defines (int4 included), so that a kind this vendor
    # does not declare is refused below as such, not as a wrong type.
    if isinstance(x, (hal.QuantizedTensor, hal.PackedInt4Tensor)):
        data = x.data
        if data.dim() != 2:
            raise invalid("x", "2-D data [M, K]", tuple(data.shape))
    elif isinstance(x, torch.Tensor):
        data = x
        if data.dim() != 2:
            raise invalid("x", "a 2-D tensor [M, K]", tuple(data.shape))
    else:
        raise invalid("x", "a torch.Tensor, a hal.QuantizedTensor or a hal.PackedInt4Tensor", type(x).__name__)
    if not isinstance(weight, hal.QuantizedWeight):
        raise invalid("weight", "a hal.QuantizedWeight", type(weight).__name__)
    if not isinstance(groups, hal.Groups):
        raise invalid("groups", "a hal.Groups", type(groups).__name__)

    kind = hal.gemm_kind_of(x, weight)  # InvalidInput for a pairing hal does not define
    if kind not in capabilities.grouped_matmul:
        raise hal.UnsupportedCapability(
            f"vendor {vendor!r} does not declare the {kind} grouped matmul "
            f"(declared: {names(capabilities.grouped_matmul)})"
        )
    for name, tensor in (("x", data), ("weight", weight.data)):
        if tensor.device.type != "cpu":
            raise invalid(name, "a tensor on the CPU", str(tensor.device))

    m, k = data.shape
    experts, n = weight.num_experts, weight.out_features
    if k != weight.in_features:
        raise invalid("x, weight", "x [M, K] and weight [E, K, N] with the same K",
                      f"x {tuple(data.shape)} and weight {tuple(weight.data.shape)}")
    _check_limits(capabilities.limits, m, k, n, experts)
    if groups.num_groups != experts:
        raise invalid("groups", f"{experts} groups (one per expert of weight)", groups.num_groups)
    if out_dtype is None:
        out_dtype = data.dtype if kind in _FLOAT_KINDS else torch.bfloat16
    _check_out_dtype(out_dtype)

    # The template reads the group sizes on the host; a device kernel usually takes the
    # group tensor as it is, without this round trip.
    counts = groups.counts().tolist()
    if any(c < 0 for c in counts):
        raise invalid(f"groups ({groups.kind})", "non-negative rows per group (non-decreasing offsets)",
                      groups.tensor.tolist())
    if sum(counts) != m:
        raise invalid(f"groups ({groups.kind})", f"groups covering the M={m} rows of x", sum(counts))

    out = torch.empty((m, n), dtype=out_dtype, device=data.device)  # every row is written below
    start = 0
    for g, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        if kind in _FLOAT_KINDS:
            product = data[rows].to(torch.float32) @ weight.data[g].to(torch.float32)
        else:
            exact = data[rows].to(torch.float64) @ weight.data[g].to(torch.float64)
            product = exact * x.scale[rows, None].to(torch.float64) * weight.scale[g][None, :].to(torch.float64)
        out[rows] = product.to(out_dtype)
        start += count
    return out


def _check_limits(limits: hal.KernelLimits, m: int, k: int, n: int, experts: int) -> None:
    """Enforce every declared kernel limit (None = unlimited)."""
    for what, limit_name, limit, value in (
        ("rows M", "max_group_rows", limits.max_group_rows, m),
        ("K", "max_inner_dim", limits.max_inner_dim, k),
        ("N", "max_inner_dim", limits.max_inner_dim, n),
        ("experts (groups)", "max_groups", limits.max_groups, experts),
    ):
        if limit is not None and value > limit:
            raise invalid(f"grouped_matmul {what}", f"at most {limit} (declared kernel limit {limit_name})",
                          value)


# -- activation function ---------------------------------------------------------------------------


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`silu(a) * b`, a the first and b the second half of the last dimension; fp32 math, x's dtype."""
    if not isinstance(x, torch.Tensor):
        raise invalid("x", "a torch.Tensor", type(x).__name__)
    if x.dtype not in FLOAT_DTYPES:
        raise invalid("x", f"a {_FLOAT_NAMES} tensor", x.dtype)
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise invalid("x", "a last dimension that is even and non-zero (gate and up halves)", tuple(x.shape))
    gate, up = x.to(torch.float32).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


# -- checks ----------------------------------------------------------------------------------------


def _check_activations(name: str, x: object) -> None:
    """A float tensor `[..., H]` with H > 0, on the CPU, all values finite."""
    if not isinstance(x, torch.Tensor):
        raise invalid(name, "a torch.Tensor", type(x).__name__)
    if x.dtype not in FLOAT_DTYPES:
        raise invalid(name, f"a {_FLOAT_NAMES} tensor", x.dtype)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise invalid(name, "at least one dimension and a non-empty last dimension", tuple(x.shape))
    if x.device.type != "cpu":
        raise invalid(name, "a tensor on the CPU", str(x.device))
    _check_finite(name, x)


def _check_finite(name: str, x: torch.Tensor) -> None:
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        # A scale computed from inf or NaN would poison every value of its row.
        raise hal.InvalidInput(f"{name}: expected finite values, got {bad} non-finite (inf or NaN) of {x.numel()}")


def _check_out_dtype(out_dtype: object) -> None:
    if out_dtype not in FLOAT_DTYPES:
        raise invalid("out_dtype", _FLOAT_NAMES, out_dtype)


def _activation_layout(layout: hal.ScaleLayout | str | None, dtype: hal.DispatchDtype) -> hal.ScaleLayout:
    """`layout`, or the dtype's default when None; InvalidInput unless valid for `dtype`."""
    if layout is None:
        return dtype.default_scale_layout
    allowed = dtype.scale_layouts()
    return _layout_in(layout, allowed, f"None or one of {names(allowed)} for {dtype}")


def _layout_in(layout: object, allowed: object, expected: str) -> hal.ScaleLayout:
    """`layout` parsed as a `ScaleLayout` if it is one of `allowed`; InvalidInput otherwise."""
    try:
        parsed = hal.ScaleLayout(layout)
    except (ValueError, TypeError):
        parsed = None
    if parsed not in allowed:
        raise invalid("layout", expected, getattr(layout, "value", layout))
    return parsed


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """`scale` with zeros replaced by ones, to divide by: an all-zero row then stays 0, not NaN."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)
