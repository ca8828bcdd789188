"""CPU emulation of the five torch_npu ops that moe-hal's Ascend vendor calls.

Each method has the name and signature of the torch_npu op it stands for, computes the
result the op's documentation describes, and rejects the arguments the documentation
(or the op's meta registration) rejects, with a `RuntimeError` naming the op, the
parameter, what is allowed and what was given. Features the documentation lists but
this emulation does not compute raise `NotImplementedError` ("not emulated").

Sources: the op docstrings in torch_npu's `_op_plugin_docs.py` and the shape/dtype rules
in `op_plugin/meta/_meta_registrations.py` (torch-npu 2.13.0 wheel).

Numerics (assumption, everywhere): arithmetic in float32 (float64 for exact integer
matrix products), a single cast to the output dtype at the end, and `torch.round`
(half to even) for integer rounding.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from types import MappingProxyType

import torch
import torch.nn.functional as F

_SOC_PREFIXES = (("Ascend910_93", "A3"), ("Ascend910B", "A2"), ("Ascend950", "A5"))  # name prefix -> generation
_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_FP8_MAX = MappingProxyType({torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0})  # largest finite
_INT8_MAX = 127.0
_INT4_MAX = 7.0
_INT4_PER_WORD = 8
_INNER_LIMIT = 65536  # A2/A3 bound on the last (memory-inner) dimension of GMM operands
_MAX_LIST = 128
_MAX_GROUPS_3D = 1024
_GMM = "npu_grouped_matmul"
_GMM_PAIRINGS = (
    "(fp16|bf16|fp32 x same dtype), (int8 x int8), (int32-packed int4 x int32-packed int4), "
    "(fp16|bf16 x int8|int32-packed int4 with antiquant_scale), (float8 x float8, A5 only)"
)


def _err(op: str, message: str) -> RuntimeError:
    return RuntimeError(f"{op}: {message}")


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "None" if dtype is None else str(dtype).replace("torch.", "")


def _tensor(op: str, name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _err(op, f"{name} must be a tensor, got {type(value).__name__}")
    return value


def _check_dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(_dtype_name(d) for d in allowed)
        raise _err(op, f"{name} dtype must be one of [{names}], got {_dtype_name(t.dtype)}")


def _check_shape(op: str, name: str, t: torch.Tensor, shape: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise _err(op, f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack integers in [-8, 7] along the last dim, 8 per int32: value j of each run of
    eight fills bits 4j..4j+3 as a two's-complement nibble (lowest nibble first)."""
    nibbles = (q.to(torch.int64) & 0xF).reshape(*q.shape[:-1], q.shape[-1] // _INT4_PER_WORD, _INT4_PER_WORD)
    shifts = torch.arange(0, 4 * _INT4_PER_WORD, 4, device=q.device)
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `_pack_int4`: int32 [..., n] -> int64 [..., 8n] with values in [-8, 7]."""
    shifts = torch.arange(0, 4 * _INT4_PER_WORD, 4, device=words.device)
    nibbles = ((words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & 0xF
    signed = nibbles - 16 * (nibbles >= 8).to(torch.int64)
    return signed.reshape(*words.shape[:-1], words.shape[-1] * _INT4_PER_WORD)


def _expand_over_k(name: str, t: torch.Tensor, k: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A weight-only parameter as float32: [N] (per channel) or [G, N] (per group, G dividing K,
    each row repeated over K/G consecutive rows of the weight)."""
    _check_dtype(_GMM, name, t, (dtype,))
    if tuple(t.shape) == (n,):
        return t.to(torch.float32)
    if t.dim() == 2 and t.shape[1] == n and t.shape[0] > 0 and k % t.shape[0] == 0:
        return t.to(torch.float32).repeat_interleave(k // t.shape[0], dim=0)
    raise _err(_GMM, f"{name} per group must be [{n}] or [G, {n}] with G dividing K={k}, got {list(t.shape)}")


def _quantize_rows(xf: torch.Tensor, dtype_max: float, target: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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
    if target in _FP8_MAX:
        return scaled.clamp(-dtype_max, dtype_max).to(target), scale
    q = torch.round(scaled).clamp(-dtype_max, dtype_max)
    if target == torch.quint4x2:
        return _pack_int4(q), scale
    return q.to(torch.int8), scale


def _gmm_list(name: str, value: object) -> list[torch.Tensor]:
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= _MAX_LIST:
        got = f"{len(value)} tensors" if isinstance(value, (list, tuple)) else type(value).__name__
        raise _err(_GMM, f"{name} must be a list of 1 to {_MAX_LIST} tensors, got {got}")
    return [_tensor(_GMM, f"{name}[{i}]", t) for i, t in enumerate(value)]


def _gmm_reserved(offset: object, act_in: object, act_scale: object, act_offset: object, bias: object,
                  act_type: int) -> None:
    """Arguments the docs reserve (only None) or that this emulation does not compute."""
    for name, value in (("offset", offset), ("activation_input", act_in),
                        ("activation_quant_scale", act_scale), ("activation_quant_offset", act_offset)):
        if value is not None:
            raise _err(_GMM, f"{name} only supports None, got {type(value).__name__}")
    if bias is not None:
        raise NotImplementedError(f"{_GMM}: bias is not emulated")
    if act_type != 0:
        raise NotImplementedError(f"{_GMM}: act_type {act_type} (fused activation) is not emulated; only 0")


def _gmm_inner_limit(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> None:
    """The last dim in memory (shape[-2] for a transposed weight) must stay below 65536."""
    for name, tensors in (("x", xs), ("weight", ws)):
        for i, t in enumerate(tensors):
            if t.dim() < 2:
                raise _err(_GMM, f"{name}[{i}] must have at least 2 dims, got {list(t.shape)}")
            transposed = t.stride(-2) == 1 and t.stride(-1) == t.shape[-2] and t.shape[-1] > 1
            inner = t.shape[-2] if transposed else t.shape[-1]
            if inner >= _INNER_LIMIT:
                raise _err(_GMM, f"{name}[{i}]'s inner dim must be < {_INNER_LIMIT} "
                                 f"(the A2/A3 inner-dimension limit), got {inner}")


def _gmm_bounds(group_list: object, group_list_type: int, groups: int, rows: int) -> list[int]:
    """Row offsets [0, end_0, ..., end_{E-1}] from a validated group_list."""
    if not isinstance(group_list, torch.Tensor):
        raise _err(_GMM, f"group_list must be a torch.int64 tensor for group_type 0, got {type(group_list).__name__}")
    if group_list.dtype != torch.int64:
        raise _err(_GMM, f"group_list dtype must be int64, got {_dtype_name(group_list.dtype)}")
    _check_shape(_GMM, "group_list", group_list, [groups])
    values = group_list.tolist()
    if any(v < 0 for v in values):
        raise _err(_GMM, f"group_list must be non-negative, got {values}")
    if group_list_type == 0:
        if any(b < a for a, b in zip(values, values[1:])):
            raise _err(_GMM, f"group_list must be non-decreasing when group_list_type is 0, got {values}")
        if values[-1] != rows:
            raise _err(_GMM, f"group_list's last value must equal x's rows {rows} when group_list_type is 0, "
                             f"got {values}")
        return [0, *values]
    if group_list_type == 1:
        if groups == 1:
            raise _err(_GMM, "group_list may not have length 1 when group_list_type is 1, got length 1")
        if sum(values) != rows:
            raise _err(_GMM, f"group_list must sum to x's rows {rows} when group_list_type is 1, got {values}")
        return [0, *itertools.accumulate(values)]
    raise _err(_GMM, f"group_list_type must be 0 (cumulative) or 1 (counts), got {group_list_type}")


_Parts = tuple[list[torch.Tensor], list[torch.Tensor], list["torch.Tensor | None"]]


def _gmm_split_rows(xs: list[torch.Tensor], ws: list[torch.Tensor], group_list: object, group_list_type: int,
                    split_item: int, pts: object) -> _Parts:
    """group_type 0: x rows, weight and per-token scales of each group along M."""
    if split_item not in (2, 3):
        raise _err(_GMM, f"split_item must be 2 or 3 for group_type 0, got {split_item}")
    if len(xs) != 1:
        raise NotImplementedError(f"{_GMM}: group_type 0 with {len(xs)} x tensors is not emulated; pass one x")
    x0 = xs[0]
    if x0.dim() != 2:
        raise _err(_GMM, f"x[0] must be 2-D for group_type 0, got {list(x0.shape)}")
    if len(ws) == 1 and ws[0].dim() == 3:
        weights, limit = list(ws[0].unbind(0)), _MAX_GROUPS_3D
    elif all(w.dim() == 2 for w in ws) and len({w.shape[1] for w in ws}) == 1:
        weights, limit = ws, _MAX_LIST
    else:
        raise _err(_GMM, f"weight must be one 3-D tensor or 2-D tensors sharing N, got {[list(w.shape) for w in ws]}")
    if not 1 <= len(weights) <= limit:
        raise _err(_GMM, f"the number of groups must be in [1, {limit}], got {len(weights)}")
    bounds = _gmm_bounds(group_list, group_list_type, len(weights), x0.shape[0])
    spans = list(zip(bounds, bounds[1:]))
    if pts is None:
        return [x0[lo:hi] for lo, hi in spans], weights, [None] * len(spans)
    if not isinstance(pts, (list, tuple)) or len(pts) != 1:
        raise _err(_GMM, f"per_token_scale must be a list of one [M] tensor for group_type 0, got {pts!r:.60}")
    _check_shape(_GMM, "per_token_scale[0]", _tensor(_GMM, "per_token_scale[0]", pts[0]), [x0.shape[0]])
    return [x0[lo:hi] for lo, hi in spans], weights, [pts[0][lo:hi] for lo, hi in spans]


def _gmm_pairs(xs: list[torch.Tensor], ws: list[torch.Tensor], group_list: object, split_item: int,
               pts: object) -> _Parts:
    """group_type -1: independent (x_i, weight_i) pairs."""
    if group_list is not None:
        raise _err(_GMM, f"group_list must be None for group_type -1, got {type(group_list).__name__}")
    if split_item not in (0, 1):
        raise _err(_GMM, f"split_item must be 0 or 1 for group_type -1, got {split_item}")
    if len(xs) != len(ws) or any(t.dim() != 2 for t in [*xs, *ws]):
        raise _err(_GMM, f"group_type -1 needs as many 2-D x as 2-D weight tensors, got x "
                         f"{[list(t.shape) for t in xs]} and weight {[list(t.shape) for t in ws]}")
    if pts is None:
        return xs, ws, [None] * len(xs)
    if not isinstance(pts, (list, tuple)) or len(pts) != len(xs):
        raise _err(_GMM, f"per_token_scale must be a list of {len(xs)} tensors (one per x), got {pts!r:.60}")
    return xs, ws, [_tensor(_GMM, f"per_token_scale[{i}]", p) for i, p in enumerate(pts)]


def _per_weight(name: str, value: object, ws: list[torch.Tensor], groups: int) -> list[torch.Tensor | None]:
    """Split a per-weight argument (one tensor per weight tensor) into one entry per group."""
    if value is None:
        return [None] * groups
    if not isinstance(value, (list, tuple)) or len(value) != len(ws):
        raise _err(_GMM, f"{name} must be a list of {len(ws)} tensors (one per weight), got {value!r:.60}")
    tensors = [_tensor(_GMM, f"{name}[{i}]", t) for i, t in enumerate(value)]
    if len(ws) == 1 and ws[0].dim() == 3:
        if tensors[0].dim() < 2 or tensors[0].shape[0] != groups:
            raise _err(_GMM, f"{name}[0] must be [{groups}, ...] for a 3-D weight, got {list(tensors[0].shape)}")
        return list(tensors[0].unbind(0))
    return list(tensors)


def _gmm_one(kind: str, out_dtype: torch.dtype, xg: torch.Tensor, wg: torch.Tensor, pg: torch.Tensor | None,
             sg: torch.Tensor | None, aqs: torch.Tensor | None, aqo: torch.Tensor | None) -> torch.Tensor:
    """One group: xg [m, K] with wg [K, N] (either maybe int4 packed in int32)."""
    x2 = _unpack_int4(xg) if xg.dtype == torch.int32 else xg
    w2 = _unpack_int4(wg) if wg.dtype == torch.int32 else wg
    if x2.shape[1] != w2.shape[0]:
        raise _err(_GMM, f"x's K ({x2.shape[1]}, unpacked) must equal weight's K; got weight {list(wg.shape)}")
    if kind == "float":
        return (x2.to(torch.float32) @ w2.to(torch.float32)).to(out_dtype)
    if kind == "antiquant":
        return (x2.to(torch.float32) @ _dequant_weight(w2, aqs, aqo, xg.dtype)).to(out_dtype)
    exact = x2.to(torch.float64) @ w2.to(torch.float64)  # |acc| < 2**31 since K < 65536: no int32 overflow
    if kind == "accumulate":
        return exact.to(torch.int32)
    _check_dtype(_GMM, "scale", sg, (torch.float32,) if kind == "fp8" else (torch.float32, torch.bfloat16))
    _check_shape(_GMM, "scale (per group)", sg, [w2.shape[1]])
    y = exact.to(torch.float32) * sg.to(torch.float32)
    if pg is not None:
        _check_dtype(_GMM, "per_token_scale", pg, (torch.float32,))
        _check_shape(_GMM, "per_token_scale (per group)", pg, [x2.shape[0]])
        y = y * pg.to(torch.float32).unsqueeze(-1)
    return y.to(out_dtype)


def _dequant_weight(w: torch.Tensor, aqs: torch.Tensor | None, aqo: torch.Tensor | None,
                    x_dtype: torch.dtype) -> torch.Tensor:
    """(w + antiquant_offset) * antiquant_scale in float32, for w [K, N]."""
    k, n = w.shape
    scale = _expand_over_k("antiquant_scale", aqs, k, n, x_dtype)
    if aqo is None:
        return w.to(torch.float32) * scale
    if aqo.shape != aqs.shape:
        raise _err(_GMM, f"antiquant_offset must have antiquant_scale's shape {list(aqs.shape)}, got {list(aqo.shape)}")
    return (w.to(torch.float32) + _expand_over_k("antiquant_offset", aqo, k, n, x_dtype)) * scale


class EmulatedTorchNpu:
    """The ops of torch_npu that moe-hal's Ascend vendor calls, emulated on the CPU for one SoC.

    `soc_name` is what the real `torch_npu.npu.get_device_name()` reports; it selects the
    generation, which decides generation-specific behaviour (float8 support on A5).
    Inputs are tensors (normally on the CPU); outputs live on the inputs' device.
    """

    def __init__(self, soc_name: str = "Ascend910B3") -> None:
        if not isinstance(soc_name, str):
            raise RuntimeError(f"EmulatedTorchNpu: soc_name must be a str, got {type(soc_name).__name__}")
        for prefix, generation in _SOC_PREFIXES:
            if soc_name.startswith(prefix):
                self.soc_name: str = soc_name
                self.generation: str = generation
                return
        supported = ", ".join(f"{p}* ({g})" for p, g in _SOC_PREFIXES)
        raise RuntimeError(f"EmulatedTorchNpu: unsupported soc_name {soc_name!r}; supported prefixes: {supported}")

    # ------------------------------------------------------------------ dynamic quant
    def npu_dynamic_quant(
        self,
        x: torch.Tensor,
        *,
        smooth_scales: torch.Tensor | None = None,
        group_index: torch.Tensor | None = None,
        dst_type: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (per-row) symmetric dynamic quantization.

        Formula: with xs = x * smooth_scales (or x alone), scale = max over the last dim
        of |xs| divided by DTYPE_MAX, and y = round(xs / scale) clamped to
        [-DTYPE_MAX, DTYPE_MAX]. DTYPE_MAX is 127 for int8, 7 for int4 (quint4x2), 448
        for float8_e4m3fn and 57344 for float8_e5m2; float8 outputs are a saturating cast,
        not a rounding. `scale` is float32 with x's shape minus the last dim. For
        quint4x2, y is int32 [..., H/8], eight int4 per word, lowest nibble first.
        With `group_index` (MoE), smooth_scales is [G, H] and row r uses row g of it
        where group_index[g-1] <= r < group_index[g].
        Source: torch_npu docs (_op_plugin_docs.py) / meta registration.
        assumption: float8 destinations (in the meta function, not in the A2/A3 docs)
        are allowed only on A5; quint4x2 stays allowed on A5.
        assumption: group_index without smooth_scales is rejected. assumption: an
        all-zero row gets scale 0 and y 0; each row depends only on itself, so a
        non-finite value changes only its own row.
        """
        op = "npu_dynamic_quant"
        x = _tensor(op, "x", x)
        _check_dtype(op, "x", x, _HALF)
        if x.dim() < 2:
            raise _err(op, f"x must have at least 2 dims, got {x.dim()}")
        target, dtype_max = self._quant_target(op, dst_type)
        width = x.shape[-1]
        if target == torch.quint4x2 and width % _INT4_PER_WORD:
            raise _err(op, f"x's last dim must be divisible by 8 for dst_type quint4x2, got {width}")
        xf = x.to(torch.float32)
        if smooth_scales is not None:
            xf = xf * self._smooth_factors(op, x, smooth_scales, group_index)
        elif group_index is not None:
            raise _err(op, "group_index requires smooth_scales, got smooth_scales=None")
        return _quantize_rows(xf, dtype_max, target)

    def _quant_target(self, op: str, dst_type: object) -> tuple[torch.dtype, float]:
        allowed: dict[torch.dtype, float] = {torch.int8: _INT8_MAX, torch.quint4x2: _INT4_MAX}
        if self.generation == "A5":
            allowed.update(_FP8_MAX)
        target = torch.int8 if dst_type is None else dst_type
        if not isinstance(target, torch.dtype) or target not in allowed:
            names = ", ".join(_dtype_name(d) for d in allowed)
            raise _err(op, f"dst_type on {self.soc_name} ({self.generation}) must be None or one of [{names}], got {dst_type}")
        return target, allowed[target]

    def _smooth_factors(
        self, op: str, x: torch.Tensor, smooth: torch.Tensor, group_index: torch.Tensor | None
    ) -> torch.Tensor:
        """The per-element smoothing multipliers (float32, broadcastable to x)."""
        smooth = _tensor(op, "smooth_scales", smooth)
        width = x.shape[-1]
        if smooth.dtype != x.dtype:
            raise _err(op, f"smooth_scales dtype must equal x's ({_dtype_name(x.dtype)}), got {_dtype_name(smooth.dtype)}")
        if group_index is None:
            _check_shape(op, "smooth_scales (without group_index)", smooth, [width])
            return smooth.to(torch.float32)
        group_index = _tensor(op, "group_index", group_index)
        _check_dtype(op, "group_index", group_index, (torch.int32,))
        if smooth.dim() != 2 or smooth.shape[1] != width:
            raise _err(op, f"smooth_scales with group_index must be [G, {width}], got {list(smooth.shape)}")
        _check_shape(op, "group_index", group_index, [smooth.shape[0]])
        rows = math.prod(x.shape[:-1])
        ends = group_index.tolist()
        if any(e < 0 for e in ends) or any(later < earlier for earlier, later in zip(ends, ends[1:])):
            raise _err(op, f"group_index must be non-negative and non-decreasing, got {ends}")
        if not ends or ends[-1] != rows:
            raise _err(op, f"group_index's last value must equal the row count {rows}, got {ends}")
        row_ids = torch.arange(rows, device=x.device)
        groups = torch.searchsorted(group_index.to(torch.int64), row_ids, right=True)
        return smooth.to(torch.float32)[groups].reshape(x.shape)

    # ------------------------------------------------------------------ swiglu
    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """SwiGLU: split x into halves A, B along `dim`; out = silu(A) * B = A * sigmoid(A) * B.

        A, the first half, is the gate. x is fp32/fp16/bf16 with 1 to 8 dims; the split
        size must be even. Computed in float32 and cast once to x's dtype.
        Source: torch_npu docs (_op_plugin_docs.py) / meta registration.
        assumption: an odd split size is rejected (the meta function would floor it).
        """
        op = "npu_swiglu"
        x = _tensor(op, "x", x)
        _check_dtype(op, "x", x, _FLOAT)
        if not 1 <= x.dim() <= 8:
            raise _err(op, f"x must have 1 to 8 dims, got {x.dim()}")
        if not -x.dim() <= dim < x.dim():
            raise _err(op, f"dim must be in [{-x.dim()}, {x.dim() - 1}], got {dim}")
        if x.shape[dim] % 2:
            raise _err(op, f"x's size along dim {dim} must be even, got {x.shape[dim]}")
        gate, up = x.to(torch.float32).chunk(2, dim=dim)
        return (F.silu(gate) * up).to(x.dtype)

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
        assumption: the A4W4 pairing (int32 x and int32 weight giving N*8 outputs) comes
        from the meta function; this docs version lists int4 weights only for
        weight-only quantization.
        assumption: either float32 or bfloat16 scale may go with either bf16 or fp16
        output (the docs' table pairs bf16->bf16 and fp32->fp16).
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
            raise _err(_GMM, "all x tensors must share one dtype and all weight tensors another")
        if group_type == 0:
            x_parts, w_parts, pts_parts = _gmm_split_rows(xs, ws, group_list, group_list_type, split_item,
                                                          per_token_scale)
        elif group_type == -1:
            x_parts, w_parts, pts_parts = _gmm_pairs(xs, ws, group_list, split_item, per_token_scale)
        else:
            raise _err(_GMM, f"group_type must be -1 (no grouping) or 0 (group along M), got {group_type}")
        kind, out_dtype = self._gmm_kind(xs[0].dtype, ws[0].dtype, scale is not None, per_token_scale is not None,
                                         antiquant_scale is not None, output_dtype, len(xs) == len(ws) == 1)
        per_weight = [_per_weight(name, value, ws, len(w_parts)) for name, value in
                      (("scale", scale), ("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset))]
        outs = [_gmm_one(kind, out_dtype, *group) for group in zip(x_parts, w_parts, pts_parts, *per_weight)]
        return outs if group_type == -1 else [torch.cat(outs, dim=0)]

    def _gmm_kind(self, xd: torch.dtype, wd: torch.dtype, has_scale: bool, has_pts: bool, has_aq: bool,
                  output_dtype: object, all_single: bool) -> tuple[str, torch.dtype]:
        """Classify the dtype pairing and settle the output dtype."""
        if output_dtype is not None and not isinstance(output_dtype, torch.dtype):
            raise _err(_GMM, f"output_dtype must be a torch.dtype or None, got {output_dtype!r}")
        pair, out = f"x {_dtype_name(xd)} with weight {_dtype_name(wd)}", _dtype_name(output_dtype)
        if xd in _FLOAT and wd == xd:
            if has_scale or has_pts or has_aq:
                raise _err(_GMM, f"scale, per_token_scale and antiquant_scale must be None for {pair}")
            if output_dtype not in (None, xd):
                raise _err(_GMM, f"output_dtype for {pair} must be None or {_dtype_name(xd)}, got {out}")
            if xd == torch.float32 and not all_single:
                raise _err(_GMM, f"{pair} is supported only with one x and one weight tensor, got several")
            return "float", xd
        if xd in _HALF and wd in (torch.int8, torch.int32):
            if not has_aq or has_scale or has_pts:
                raise _err(_GMM, f"{pair} (weight-only quantization) needs antiquant_scale and no scale or "
                                 "per_token_scale")
            if output_dtype not in (None, xd):
                raise _err(_GMM, f"output_dtype for {pair} must be None or {_dtype_name(xd)}, got {out}")
            return "antiquant", xd
        fp8 = xd in _FP8_MAX and wd in _FP8_MAX
        if not (fp8 or (xd == wd and xd in (torch.int8, torch.int32))):
            raise _err(_GMM, f"unsupported dtype pairing {pair}; supported pairings: {_GMM_PAIRINGS}")
        if fp8 and self.generation != "A5":
            raise _err(_GMM, f"{pair} needs an A5 SoC (Ascend950*), this is {self.soc_name} ({self.generation})")
        if has_aq:
            raise _err(_GMM, f"antiquant_scale must be None for {pair}")
        if output_dtype in (None, torch.int8) and xd == torch.int8:
            raise NotImplementedError(f"{_GMM}: int8 output (requantization with an int64 scale) is not emulated")
        if output_dtype == torch.int32 and not fp8:
            if has_scale or has_pts:
                raise _err(_GMM, f"scale and per_token_scale must be None for int32 output of {pair}")
            return "accumulate", torch.int32
        if output_dtype not in _HALF:
            raise _err(_GMM, f"output_dtype for {pair} must be bfloat16 or float16 (or int32 without scales), got {out}")
        if not has_scale:
            raise _err(_GMM, f"scale is required for {pair} with output_dtype {out}")
        return ("fp8" if fp8 else "dequant"), output_dtype

    # ------------------------------------------------------------------ MoE routing
    def npu_moe_init_routing_v2(
        self,
        x: torch.Tensor,
        expert_idx: torch.Tensor,
        *,
        scale: torch.Tensor | None = None,
        offset: torch.Tensor | None = None,
        active_num: int = -1,
        expert_capacity: int = -1,
        expert_num: int = -1,
        drop_pad_mode: int = 0,
        expert_tokens_num_type: int = 0,
        expert_tokens_num_flag: bool = False,
        quant_mode: int = -1,
        active_expert_range: Sequence[int] | None = None,
        row_idx_type: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """MoE routing: gather each token once per chosen expert, sorted by expert.

        The NUM_ROWS*K (token, expert) pairs whose expert lies in active_expert_range
        [start, end) are sorted by expert id (stable); the d-th of them becomes row d of
        expanded_x (a copy of its token's row). expanded_row_idx (int32 [NUM_ROWS*K]) maps
        pair -> d (row_idx_type 0, gather form, -1 for inactive pairs) or d -> pair
        (row_idx_type 1, scatter form). The third output counts rows per expert: int64
        [end-start] (expert_tokens_num_type 1), or int64 [expert_num, 2] (expert, count)
        pairs for experts with a non-zero count, in id order, followed by a (0, 0) end
        marker (type 2). expanded_scale (float32) is scale[token] per row for
        quant_mode -1, or the per-row scale of a dynamic int8 quantization of the
        (optionally smoothed by scale[expert - start]) rows for quant_mode 1, with
        npu_dynamic_quant's formula.
        Source: torch_npu docs (_op_plugin_docs.py) / meta registration.
        assumption: pairs are numbered p = i*K + k (expert_idx's row-major order) and
        ties keep that order. assumption: rows past the valid ones (the docs leave them
        undefined) are zeros in expanded_x and expanded_scale, -1 in the scatter index.
        assumption: active_num > 0 keeps only the first active_num sorted pairs
        (expanded_x then has min(active_num, NUM_ROWS*K) rows, as in the meta function);
        dropped pairs get -1 and are not counted. assumption: a scale of shape [1, H]
        in quant_mode 1 (accepted by the meta function) smooths every expert alike.
        """
        op = "npu_moe_init_routing_v2"
        x = _tensor(op, "x", x)
        expert_idx = _tensor(op, "expert_idx", expert_idx)
        _check_dtype(op, "x", x, (*_FLOAT, torch.int8))
        _check_dtype(op, "expert_idx", expert_idx, (torch.int32,))
        if x.dim() != 2 or expert_idx.dim() != 2 or x.shape[0] != expert_idx.shape[0]:
            raise _err(op, f"x [NUM_ROWS, H] and expert_idx [NUM_ROWS, K] must be 2-D with equal rows, "
                           f"got {list(x.shape)} and {list(expert_idx.shape)}")
        start, end = self._routing_options(op, x, offset, active_num, expert_num, drop_pad_mode,
                                           expert_tokens_num_type, expert_tokens_num_flag, quant_mode,
                                           active_expert_range, row_idx_type)
        self._check_routing_scale(op, x, scale, quant_mode, end - start)
        ids = expert_idx.reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= expert_num):
            raise _err(op, f"expert ids must be in [0, {expert_num}), got values in [{int(ids.min())}, {int(ids.max())}]")
        pairs = ids.numel()
        rows_out = pairs if active_num <= 0 else min(active_num, pairs)
        active = ((ids >= start) & (ids < end)).nonzero().squeeze(1)
        order = torch.sort(ids[active], stable=True).indices
        kept = active[order][:rows_out]  # pair index of each valid expanded row
        n_kept = kept.numel()
        top_k = expert_idx.shape[1]
        tokens = torch.div(kept, top_k, rounding_mode="floor")
        experts = ids[kept]

        row_idx = torch.full((pairs,), -1, dtype=torch.int32, device=x.device)
        if row_idx_type == 0:
            row_idx[kept] = torch.arange(n_kept, dtype=torch.int32, device=x.device)
        else:
            row_idx[:n_kept] = kept.to(torch.int32)
        counts = torch.bincount(experts - start, minlength=end - start).to(torch.int64)
        if expert_tokens_num_type == 2:
            key_values = torch.zeros((expert_num, 2), dtype=torch.int64, device=x.device)
            present = counts.nonzero().squeeze(1)
            key_values[: present.numel(), 0] = present + start
            key_values[: present.numel(), 1] = counts[present]
            counts = key_values  # the rows after the valid pairs are zero: the (0, 0) marker

        expanded_scale = torch.zeros(rows_out, dtype=torch.float32, device=x.device)
        if quant_mode == 1:
            rows = x.to(torch.float32)[tokens]
            if scale is not None:
                smooth = scale.to(torch.float32)
                rows = rows * (smooth[experts - start] if smooth.shape[0] == end - start else smooth[0])
            expanded_x = torch.zeros((rows_out, x.shape[1]), dtype=torch.int8, device=x.device)
            expanded_x[:n_kept], expanded_scale[:n_kept] = _quantize_rows(rows, _INT8_MAX, torch.int8)
        else:
            expanded_x = x.new_zeros((rows_out, x.shape[1]))
            expanded_x[:n_kept] = x[tokens]
            if scale is not None:
                expanded_scale[:n_kept] = scale.to(torch.float32)[tokens]
        return expanded_x, row_idx, counts, expanded_scale

    def _routing_options(self, op: str, x: torch.Tensor, offset: object, active_num: int, expert_num: int,
                         drop_pad_mode: int, num_type: int, num_flag: bool, quant_mode: int,
                         active_expert_range: Sequence[int] | None, row_idx_type: int) -> tuple[int, int]:
        """Validate the integer options; returns the active expert range [start, end)."""
        limit = 5120 if num_type == 2 else 10240
        rules = (
            (offset is None, "offset must be None (neither supported mode uses it), got a tensor"),
            (drop_pad_mode == 0, f"drop_pad_mode: only 0 (dropless) is supported, got {drop_pad_mode}"),
            (num_type in (1, 2), f"expert_tokens_num_type: only 1 and 2 are supported (count, key_value), got {num_type}"),
            (num_flag is True, f"expert_tokens_num_flag: only True is supported, got {num_flag}"),
            (quant_mode in (-1, 1), f"quant_mode: only -1 (none) and 1 (dynamic int8) are supported, got {quant_mode}"),
            (quant_mode != 1 or x.dtype != torch.int8, "quant_mode must be -1 when x is int8 (no requantization), got 1"),
            (row_idx_type in (0, 1), f"row_idx_type must be 0 (gather) or 1 (scatter), got {row_idx_type}"),
            (active_num >= -1, f"active_num must be >= -1, got {active_num}"),
            (0 < expert_num <= limit, f"expert_num must be in (0, {limit}] for expert_tokens_num_type {num_type}, "
                                      f"got {expert_num}"),
        )
        for ok, message in rules:
            if not ok:
                raise _err(op, message)
        if active_expert_range is None or len(active_expert_range) == 0:
            return 0, expert_num
        bounds = list(active_expert_range)
        if len(bounds) != 2 or not 0 <= bounds[0] < bounds[1] <= expert_num:
            raise _err(op, f"active_expert_range must be [start, end) with 0 <= start < end <= expert_num "
                           f"({expert_num}), got {bounds}")
        return int(bounds[0]), int(bounds[1])

    @staticmethod
    def _check_routing_scale(op: str, x: torch.Tensor, scale: torch.Tensor | None, quant_mode: int,
                             experts: int) -> None:
        if scale is None:
            return
        scale = _tensor(op, "scale", scale)
        _check_dtype(op, "scale", scale, (torch.float32,))
        if quant_mode == -1 and tuple(scale.shape) != (x.shape[0],):
            raise _err(op, f"scale must be [NUM_ROWS] = [{x.shape[0]}] when quant_mode is -1, got {list(scale.shape)}")
        if quant_mode == 1 and (scale.dim() != 2 or scale.shape[0] not in (experts, 1) or scale.shape[1] != x.shape[1]):
            raise _err(op, f"scale must be [{experts} or 1, {x.shape[1]}] when quant_mode is 1, got {list(scale.shape)}")

    def npu_moe_finalize_routing(
        self,
        expanded_permuted_rows: torch.Tensor,
        skip1: torch.Tensor | None,
        skip2: torch.Tensor | None,
        bias: torch.Tensor | None,
        scales: torch.Tensor | None,
        expanded_src_to_dst_row: torch.Tensor,
        export_for_source_row: torch.Tensor | None,
        drop_pad_mode: int = 0,
        k: int = 1,
    ) -> torch.Tensor:
        """MoE combine: weighted sum of each token's K expert outputs, plus skips and bias.

        Formula: out[i, j] = skip1[i, j] + skip2[i, j] + sum over k of scales[i, k] *
        (rows[src_to_dst[i + k*NUM_ROWS], j] + bias[export_for_source_row[i, k], j]).
        The index into expanded_src_to_dst_row is k-major (i + k*NUM_ROWS). Missing
        skips and bias contribute nothing; without scales every weight is 1 and K is
        `k`. NUM_ROWS = rows / K. Computed in float32, cast once to the rows' dtype.
        Source: torch_npu docs (_op_plugin_docs.py) / meta registration.
        assumption: when scales is given its second dim is K and `k` is not consulted.
        """
        op = "npu_moe_finalize_routing"
        rows = _tensor(op, "expanded_permuted_rows", expanded_permuted_rows)
        src = _tensor(op, "expanded_src_to_dst_row", expanded_src_to_dst_row)
        if drop_pad_mode in (1, 3):
            raise NotImplementedError(f"{op}: drop_pad_mode {drop_pad_mode} (drop-pad layout) is not emulated; only 0")
        if drop_pad_mode != 0:
            raise _err(op, f"drop_pad_mode must be 0, got {drop_pad_mode}")
        _check_dtype(op, "expanded_permuted_rows", rows, _FLOAT)
        if rows.dim() != 2:
            raise _err(op, f"expanded_permuted_rows must be 2-D [NUM_ROWS*K, H], got {list(rows.shape)}")
        top_k = scales.shape[1] if isinstance(scales, torch.Tensor) and scales.dim() == 2 else k
        if top_k <= 0 or rows.shape[0] % top_k:
            raise _err(op, f"K ({top_k}) must be positive and divide expanded_permuted_rows' rows {rows.shape[0]}")
        num_rows, hidden = rows.shape[0] // top_k, rows.shape[1]
        _check_dtype(op, "expanded_src_to_dst_row", src, (torch.int32,))
        _check_shape(op, "expanded_src_to_dst_row", src, [num_rows * top_k])
        if src.numel() and (int(src.min()) < 0 or int(src.max()) >= num_rows * top_k):
            raise _err(op, f"expanded_src_to_dst_row values must be in [0, {num_rows * top_k - 1}], "
                           f"got values in [{int(src.min())}, {int(src.max())}]")
        for name, t, shape in (("scales", scales, [num_rows, top_k]), ("skip1", skip1, [num_rows, hidden]),
                               ("skip2", skip2, [num_rows, hidden])):
            if t is not None:
                _check_dtype(op, name, _tensor(op, name, t), (rows.dtype,))
                _check_shape(op, name, t, shape)
        if skip2 is None and skip1 is not None:
            raise _err(op, "skip1 must be None when skip2 is None")
        gathered = rows.to(torch.float32)[src.to(torch.int64).reshape(top_k, num_rows).t()]  # [NUM_ROWS, K, H]
        if export_for_source_row is not None:
            experts = _tensor(op, "export_for_source_row", export_for_source_row)
            _check_dtype(op, "export_for_source_row", experts, (torch.int32,))
            _check_shape(op, "export_for_source_row", experts, [num_rows, top_k])
        if bias is not None:
            gathered = gathered + self._finalize_bias(op, rows, bias, export_for_source_row)
        weights = torch.ones((num_rows, top_k), device=rows.device) if scales is None else scales.to(torch.float32)
        out = (gathered * weights.unsqueeze(-1)).sum(dim=1)
        for skip in (skip1, skip2):
            if skip is not None:
                out = out + skip.to(torch.float32)
        return out.to(rows.dtype)

    @staticmethod
    def _finalize_bias(op: str, rows: torch.Tensor, bias: torch.Tensor,
                       experts: torch.Tensor | None) -> torch.Tensor:
        """bias[expert(i, k)] as float32 [NUM_ROWS, K, H]."""
        bias = _tensor(op, "bias", bias)
        _check_dtype(op, "bias", bias, (rows.dtype,))
        if bias.dim() != 2 or bias.shape[1] != rows.shape[1]:
            raise _err(op, f"bias must be [E, {rows.shape[1]}], got {list(bias.shape)}")
        if experts is None:
            raise _err(op, "export_for_source_row is required when bias is given, got None")
        ids = experts.to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bias.shape[0]):
            raise _err(op, f"export_for_source_row values must be in [0, {bias.shape[0]}), "
                           f"got values in [{int(ids.min())}, {int(ids.max())}]")
        return bias.to(torch.float32)[ids]
