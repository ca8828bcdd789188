"""The emulation of `torch_npu.npu_grouped_matmul` (sources and numerics: `vendors.ascend.emulation.torch_npu_ops`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from vendors.ascend.emulation.common import (
    err,
    dtype_name,
    tensor_arg,
    check_dtype,
    check_shape,
    unpack_int4,
    expand_over_k,
    HALF,
    FLOAT,
    FP8_MAX,
    INNER_LIMIT,
    MAX_LIST,
    MAX_GROUPS_3D,
    GMM,
    GMM_PAIRINGS,
)


def _gmm_list(name: str, value: object) -> list[torch.Tensor]:
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= MAX_LIST:
        got = f"{len(value)} tensors" if isinstance(value, (list, tuple)) else type(value).__name__
        raise err(GMM, f"{name} must be a list of 1 to {MAX_LIST} tensors, got {got}")
    return [tensor_arg(GMM, f"{name}[{i}]", t) for i, t in enumerate(value)]


def _gmm_reserved(
    offset: object, act_in: object, act_scale: object, act_offset: object, bias: object, act_type: int
) -> None:
    """Arguments the docs reserve (only None) or that this emulation does not compute."""
    for name, value in (
        ("offset", offset),
        ("activation_input", act_in),
        ("activation_quant_scale", act_scale),
        ("activation_quant_offset", act_offset),
    ):
        if value is not None:
            raise err(GMM, f"{name} only supports None, got {type(value).__name__}")
    if bias is not None:
        raise NotImplementedError(f"{GMM}: bias is not emulated")
    if act_type != 0:
        raise NotImplementedError(f"{GMM}: act_type {act_type} (fused activation) is not emulated; only 0")


def _gmm_inner_limit(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> None:
    """The last dim in memory (shape[-2] for a transposed weight) must stay below 65536."""
    for name, tensors in (("x", xs), ("weight", ws)):
        for i, t in enumerate(tensors):
            if t.dim() < 2:
                raise err(GMM, f"{name}[{i}] must have at least 2 dims, got {list(t.shape)}")
            transposed = t.stride(-2) == 1 and t.stride(-1) == t.shape[-2] and t.shape[-1] > 1
            inner = t.shape[-2] if transposed else t.shape[-1]
            if inner >= INNER_LIMIT:
                raise err(
                    GMM,
                    f"{name}[{i}]'s inner dim must be < {INNER_LIMIT} (the A2/A3 inner-dimension limit), got {inner}",
                )


def _gmm_bounds(group_list: object, group_list_type: int, groups: int, rows: int) -> list[int]:
    """Row offsets [0, end_0, ..., end_{E-1}] from a validated group_list."""
    if not isinstance(group_list, torch.Tensor):
        raise err(GMM, f"group_list must be a torch.int64 tensor for group_type 0, got {type(group_list).__name__}")
    if group_list.dtype != torch.int64:
        raise err(GMM, f"group_list dtype must be int64, got {dtype_name(group_list.dtype)}")
    check_shape(GMM, "group_list", group_list, [groups])
    values = group_list.tolist()
    if any(v < 0 for v in values):
        raise err(GMM, f"group_list must be non-negative, got {values}")
    if group_list_type == 0:
        if any(b < a for a, b in zip(values, values[1:])):
            raise err(GMM, f"group_list must be non-decreasing when group_list_type is 0, got {values}")
        if values[-1] > rows:
            raise err(
                GMM, f"group_list's last value must not exceed x's rows {rows} when group_list_type is 0, got {values}"
            )
        return [0, *values]
    if group_list_type == 1:
        if groups == 1:
            raise err(GMM, "group_list may not have length 1 when group_list_type is 1, got length 1")
        if sum(values) > rows:
            raise err(GMM, f"group_list must sum to at most x's rows {rows} when group_list_type is 1, got {values}")
        return [0, *itertools.accumulate(values)]
    raise err(GMM, f"group_list_type must be 0 (cumulative) or 1 (counts), got {group_list_type}")


#: int8 x int8 with a per-channel scale (with or without per_token_scale): the scale dtype each
#: output dtype takes in the A2/A3 dtype table of `_op_plugin_docs.py` (2.8.0 and 2.13.0).
_SCALE_FOR_OUTPUT = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}

_Parts = tuple[list[torch.Tensor], list[torch.Tensor], list["torch.Tensor | None"]]


def _gmm_split_rows(
    xs: list[torch.Tensor],
    ws: list[torch.Tensor],
    group_list: object,
    group_list_type: int,
    split_item: int,
    pts: object,
) -> _Parts:
    """group_type 0: x rows, weight and per-token scales of each group along M."""
    if split_item not in (2, 3):
        raise err(GMM, f"split_item must be 2 or 3 for group_type 0, got {split_item}")
    if len(xs) != 1:
        raise NotImplementedError(f"{GMM}: group_type 0 with {len(xs)} x tensors is not emulated; pass one x")
    x0 = xs[0]
    if x0.dim() != 2:
        raise err(GMM, f"x[0] must be 2-D for group_type 0, got {list(x0.shape)}")
    if len(ws) == 1 and ws[0].dim() == 3:
        weights, limit = list(ws[0].unbind(0)), MAX_GROUPS_3D
    elif all(w.dim() == 2 for w in ws) and len({w.shape[1] for w in ws}) == 1:
        weights, limit = ws, MAX_LIST
    else:
        raise err(GMM, f"weight must be one 3-D tensor or 2-D tensors sharing N, got {[list(w.shape) for w in ws]}")
    if not 1 <= len(weights) <= limit:
        raise err(GMM, f"the number of groups must be in [1, {limit}], got {len(weights)}")
    bounds = _gmm_bounds(group_list, group_list_type, len(weights), x0.shape[0])
    spans = list(zip(bounds, bounds[1:]))
    if pts is None:
        return [x0[lo:hi] for lo, hi in spans], weights, [None] * len(spans)
    if not isinstance(pts, (list, tuple)) or len(pts) != 1:
        raise err(GMM, f"per_token_scale must be a list of one [M] tensor for group_type 0, got {pts!r:.60}")
    check_shape(GMM, "per_token_scale[0]", tensor_arg(GMM, "per_token_scale[0]", pts[0]), [x0.shape[0]])
    return [x0[lo:hi] for lo, hi in spans], weights, [pts[0][lo:hi] for lo, hi in spans]


def _gmm_pairs(
    xs: list[torch.Tensor], ws: list[torch.Tensor], group_list: object, split_item: int, pts: object
) -> _Parts:
    """group_type -1: independent (x_i, weight_i) pairs."""
    if group_list is not None:
        raise err(GMM, f"group_list must be None for group_type -1, got {type(group_list).__name__}")
    if split_item not in (0, 1):
        raise err(GMM, f"split_item must be 0 or 1 for group_type -1, got {split_item}")
    if len(xs) != len(ws) or any(t.dim() != 2 for t in [*xs, *ws]):
        raise err(
            GMM,
            f"group_type -1 needs as many 2-D x as 2-D weight tensors, got x "
            f"{[list(t.shape) for t in xs]} and weight {[list(t.shape) for t in ws]}",
        )
    if pts is None:
        return xs, ws, [None] * len(xs)
    if not isinstance(pts, (list, tuple)) or len(pts) != len(xs):
        raise err(GMM, f"per_token_scale must be a list of {len(xs)} tensors (one per x), got {pts!r:.60}")
    return xs, ws, [tensor_arg(GMM, f"per_token_scale[{i}]", p) for i, p in enumerate(pts)]


def _per_weight(name: str, value: object, ws: list[torch.Tensor], groups: int) -> list[torch.Tensor | None]:
    """Split a per-weight argument (one tensor per weight tensor) into one entry per group."""
    if value is None:
        return [None] * groups
    if not isinstance(value, (list, tuple)) or len(value) != len(ws):
        raise err(GMM, f"{name} must be a list of {len(ws)} tensors (one per weight), got {value!r:.60}")
    tensors = [tensor_arg(GMM, f"{name}[{i}]", t) for i, t in enumerate(value)]
    if len(ws) == 1 and ws[0].dim() == 3:
        if tensors[0].dim() < 2 or tensors[0].shape[0] != groups:
            raise err(GMM, f"{name}[0] must be [{groups}, ...] for a 3-D weight, got {list(tensors[0].shape)}")
        return list(tensors[0].unbind(0))
    return list(tensors)


def _gmm_one(
    kind: str,
    out_dtype: torch.dtype,
    xg: torch.Tensor,
    wg: torch.Tensor,
    pg: torch.Tensor | None,
    sg: torch.Tensor | None,
    aqs: torch.Tensor | None,
    aqo: torch.Tensor | None,
) -> torch.Tensor:
    """One group: xg [m, K] with wg [K, N] (either maybe int4 packed in int32)."""
    x2 = unpack_int4(xg) if xg.dtype == torch.int32 else xg
    w2 = unpack_int4(wg) if wg.dtype == torch.int32 else wg
    if x2.shape[1] != w2.shape[0]:
        raise err(GMM, f"x's K ({x2.shape[1]}, unpacked) must equal weight's K; got weight {list(wg.shape)}")
    if kind == "float":
        return (x2.to(torch.float32) @ w2.to(torch.float32)).to(out_dtype)
    if kind == "antiquant":
        return (x2.to(torch.float32) @ _dequant_weight(w2, aqs, aqo, xg.dtype)).to(out_dtype)
    exact = x2.to(torch.float64) @ w2.to(torch.float64)  # |acc| < 2**31 since K < 65536: no int32 overflow
    if kind == "accumulate":
        return exact.to(torch.int32)
    if kind == "fp8":
        check_dtype(GMM, "scale", sg, (torch.float32,))
    elif sg.dtype != _SCALE_FOR_OUTPUT[out_dtype]:  # the int8 rows of the dtype table pair them
        raise err(
            GMM,
            f"scale dtype {dtype_name(sg.dtype)} with output_dtype {dtype_name(out_dtype)} is not a "
            f"supported combination for int8 x int8: bfloat16 scale -> bfloat16 output, float32 scale "
            f"-> float16 output",
        )
    check_shape(GMM, "scale (per group)", sg, [w2.shape[1]])
    y = exact.to(torch.float32) * sg.to(torch.float32)
    if pg is not None:
        check_dtype(GMM, "per_token_scale", pg, (torch.float32,))
        check_shape(GMM, "per_token_scale (per group)", pg, [x2.shape[0]])
        y = y * pg.to(torch.float32).unsqueeze(-1)
    return y.to(out_dtype)


def _undefined_tail(y: torch.Tensor, rows: int) -> torch.Tensor:
    """y [covered, N] extended to x's rows: rows past group_list's total are undefined on
    hardware (engines pass padded buffers), so they are NaN here (int32: INT32_MIN), for
    nobody to rely on. Source: the reference notes; the docs require the totals to match.
    """
    if y.shape[0] == rows:
        return y
    fill = float("nan") if y.dtype.is_floating_point else torch.iinfo(y.dtype).min
    return torch.cat([y, y.new_full((rows - y.shape[0], y.shape[1]), fill)], dim=0)


def _dequant_weight(
    w: torch.Tensor, aqs: torch.Tensor | None, aqo: torch.Tensor | None, x_dtype: torch.dtype
) -> torch.Tensor:
    """(w + antiquant_offset) * antiquant_scale in float32, for w [K, N]."""
    k, n = w.shape
    scale = expand_over_k("antiquant_scale", aqs, k, n, x_dtype)
    if aqo is None:
        return w.to(torch.float32) * scale
    if aqo.shape != aqs.shape:
        raise err(GMM, f"antiquant_offset must have antiquant_scale's shape {list(aqs.shape)}, got {list(aqo.shape)}")
    return (w.to(torch.float32) + expand_over_k("antiquant_offset", aqo, k, n, x_dtype)) * scale


class GroupedMatmulOps:
    """`npu_grouped_matmul`, emulated (a mixin of `EmulatedTorchNpu`, which sets `generation`)."""

    # ------------------------------------------------------------------ grouped matmul
    def npu_grouped_matmul(
        self,
        x: Sequence[torch.Tensor],
        weight: Sequence[torch.Tensor],
        *,
        bias: Sequence[torch.Tensor] | None = None,
        scale: Sequence[torch.Tensor] | None = None,
        offset: Sequence[torch.Tensor] | None = None,
        antiquant_scale: Sequence[torch.Tensor] | None = None,
        antiquant_offset: Sequence[torch.Tensor] | None = None,
        per_token_scale: Sequence[torch.Tensor] | None = None,
        group_list: torch.Tensor | None = None,
        activation_input: Sequence[torch.Tensor] | None = None,
        activation_quant_scale: Sequence[torch.Tensor] | None = None,
        activation_quant_offset: Sequence[torch.Tensor] | None = None,
        split_item: int = 0,
        group_type: int | None = None,
        group_list_type: int = 0,
        act_type: int = 0,
        output_dtype: torch.dtype | None = None,
        tuning_config: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """Grouped GEMM, one matmul per group.

        Formulas per group g: float y = x_g @ w_g; per-channel quant y = (x_g @ w_g) *
        scale_g; per-token quant y = (x_g @ w_g) * scale_g[n] * per_token_scale[m];
        weight-only quant y = x_g @ ((w_g + antiquant_offset_g) * antiquant_scale_g).
        Forms: group_type 0 with one x [M, K] and one weight [E, K, N] (E <= 1024) or E
        weights [K, N], rows split by group_list, split_item 2/3, one [M, N] output;
        group_type -1 with paired lists, group_list None, split_item 0/1, one output per
        pair. group_list is an int64 tensor: cumulative end rows (group_list_type 0) or
        row counts (1, length != 1). int4 is carried as int32, 8 values per word along
        the last dim (as npu_dynamic_quant's quint4x2 output).
        Source: torch_npu docs (_op_plugin_docs.py) / meta registration.
        assumption: int8/int4 x int8/int4 with output_dtype int32 returns the raw integer
        accumulator (the meta function accepts int32; the docs' table does not list it).
        int4 x int4 (int32 x and int32 weight) is rejected: the docs list int4 weights only
        for weight-only quantization (the meta function shapes it, but the documented A4W4
        path needs an NZ weight and a uint64 scale, not modelled).
        int8 x int8 pairs the scale dtype with the output dtype as the docs' table does:
        bfloat16 scale -> bfloat16 output, float32 scale -> float16 output; others rejected.
        Rows of x past group_list's total are accepted (hardware accepts padded buffers;
        the docs say the totals match): their output rows are NaN (int32: INT32_MIN).
        assumption: the docs' "only when x, weight and y are single tensors" note on the
        float32 column restricts float32 x/weight (whatever output_dtype says) to one x
        and one weight tensor.
        assumption: float8 needs A5, takes a float32 scale, and per_token_scale is
        optional (as for int8); the 65536 inner-dimension limit (documented for A2/A3)
        applies to A5 too. assumption: weight-only quantization dequantizes in float32.
        Not emulated: group_type 0 with several x tensors, x of more than 2 dims.
        tuning_config is a performance hint and is ignored.
        """
        xs, ws = _gmm_list("x", x), _gmm_list("weight", weight)
        _gmm_reserved(offset, activation_input, activation_quant_scale, activation_quant_offset, bias, act_type)
        _gmm_inner_limit(xs, ws)
        if len({t.dtype for t in xs}) != 1 or len({t.dtype for t in ws}) != 1:
            raise err(GMM, "all x tensors must share one dtype and all weight tensors another")
        if group_type == 0:
            x_parts, w_parts, pts_parts = _gmm_split_rows(
                xs, ws, group_list, group_list_type, split_item, per_token_scale
            )
        elif group_type == -1:
            x_parts, w_parts, pts_parts = _gmm_pairs(xs, ws, group_list, split_item, per_token_scale)
        else:
            raise err(GMM, f"group_type must be -1 (no grouping) or 0 (group along M), got {group_type}")
        kind, out_dtype = self._gmm_kind(
            xs[0].dtype,
            ws[0].dtype,
            scale is not None,
            per_token_scale is not None,
            antiquant_scale is not None,
            output_dtype,
            len(xs) == len(ws) == 1,
        )
        per_weight = [
            _per_weight(name, value, ws, len(w_parts))
            for name, value in (
                ("scale", scale),
                ("antiquant_scale", antiquant_scale),
                ("antiquant_offset", antiquant_offset),
            )
        ]
        outs = [_gmm_one(kind, out_dtype, *group) for group in zip(x_parts, w_parts, pts_parts, *per_weight)]
        return outs if group_type == -1 else [_undefined_tail(torch.cat(outs, dim=0), xs[0].shape[0])]

    def _gmm_kind(
        self,
        xd: torch.dtype,
        wd: torch.dtype,
        has_scale: bool,
        has_pts: bool,
        has_aq: bool,
        output_dtype: object,
        all_single: bool,
    ) -> tuple[str, torch.dtype]:
        """Classify the dtype pairing and settle the output dtype."""
        if output_dtype is not None and not isinstance(output_dtype, torch.dtype):
            raise err(GMM, f"output_dtype must be a torch.dtype or None, got {output_dtype!r}")
        pair, out = f"x {dtype_name(xd)} with weight {dtype_name(wd)}", dtype_name(output_dtype)
        if xd in FLOAT and wd == xd:
            if has_scale or has_pts or has_aq:
                raise err(GMM, f"scale, per_token_scale and antiquant_scale must be None for {pair}")
            if output_dtype not in (None, xd):
                raise err(GMM, f"output_dtype for {pair} must be None or {dtype_name(xd)}, got {out}")
            if xd == torch.float32 and not all_single:
                raise err(GMM, f"{pair} is supported only with one x and one weight tensor, got several")
            return "float", xd
        if xd in HALF and wd in (torch.int8, torch.int32):
            if not has_aq or has_scale or has_pts:
                raise err(
                    GMM, f"{pair} (weight-only quantization) needs antiquant_scale and no scale or per_token_scale"
                )
            if output_dtype not in (None, xd):
                raise err(GMM, f"output_dtype for {pair} must be None or {dtype_name(xd)}, got {out}")
            return "antiquant", xd
        fp8 = xd in FP8_MAX and wd in FP8_MAX
        if xd == wd == torch.int32:  # A4W4: only an NZ weight with a uint64 scale, neither modelled
            raise err(
                GMM,
                f"{pair} (int4 x int4) is not a documented ND pairing: int4 weights are listed for "
                "weight-only quantization with float x; supported pairings: " + GMM_PAIRINGS,
            )
        if not (fp8 or (xd == wd == torch.int8)):
            raise err(GMM, f"unsupported dtype pairing {pair}; supported pairings: {GMM_PAIRINGS}")
        if fp8 and self.generation != "A5":
            raise err(GMM, f"{pair} needs an A5 SoC (Ascend950*), this is {self.soc_name} ({self.generation})")
        if has_aq:
            raise err(GMM, f"antiquant_scale must be None for {pair}")
        if output_dtype in (None, torch.int8) and xd == torch.int8:
            raise NotImplementedError(f"{GMM}: int8 output (requantization with an int64 scale) is not emulated")
        if output_dtype == torch.int32 and not fp8:
            if has_scale or has_pts:
                raise err(GMM, f"scale and per_token_scale must be None for int32 output of {pair}")
            return "accumulate", torch.int32
        if output_dtype not in HALF:
            raise err(GMM, f"output_dtype for {pair} must be bfloat16 or float16 (or int32 without scales), got {out}")
        if not has_scale:
            raise err(GMM, f"scale is required for {pair} with output_dtype {out}")
        return ("fp8" if fp8 else "dequant"), output_dtype
