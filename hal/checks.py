"""The argument checks of hal's ops, made once for every vendor by `hal.Vendor`.

Only what can be seen without reading device values: types, dtypes, shapes, devices,
kernel limits. Value checks (finite inputs, group lists that add up) would cost a host
synchronisation on an accelerator; implementations that can afford them make them.
"""

from __future__ import annotations

import torch

from hal.activations import Activation
from hal.capabilities import KernelLimits
from hal.dtypes import FLOAT_DTYPES, INT4_PER_WORD, WEIGHT_LAYOUTS, DispatchDtype, ScaleLayout
from hal.errors import invalid
from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal.gemm_kinds import GEMM_KINDS, GemmKind
from hal.groups import Groups

_FLOAT_NAMES = "torch.bfloat16, torch.float16 or torch.float32"


def on_device(name: str, t: object, device: torch.device) -> None:
    """Raise `InvalidInput` unless `t` (when a tensor) is on `device` (an index-less device matches any index)."""
    if not isinstance(t, torch.Tensor):
        return
    given = t.device
    if given.type != device.type or (device.index is not None and given.index != device.index):
        raise invalid(name, f"a tensor on device {device}", str(given))


def float_rows(name: str, x: object) -> torch.Tensor:
    """`x` as float activations `[..., H]` with H > 0, or `InvalidInput`."""
    if not isinstance(x, torch.Tensor):
        raise invalid(name, "a torch.Tensor", type(x).__name__)
    if x.dtype not in FLOAT_DTYPES:
        raise invalid(name, "a bf16, fp16 or fp32 tensor", x.dtype)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise invalid(name, "at least one dimension and a non-empty last dimension", tuple(x.shape))
    return x


def concrete_dtype(dtype: object) -> DispatchDtype:
    """A dispatch dtype other than `auto`, or `InvalidInput`."""
    parsed = DispatchDtype.parse(dtype)  # type: ignore[arg-type]
    if parsed is DispatchDtype.AUTO:
        names = ", ".join(d.value for d in DispatchDtype.concrete())
        raise invalid("dtype", f"a concrete dispatch dtype ({names})", "auto")
    return parsed


def activation_layout(layout: object, dtype: DispatchDtype, default: ScaleLayout) -> ScaleLayout:
    """`layout` parsed and allowed for `dtype` (None: `default`), or `InvalidInput`."""
    allowed = dtype.scale_layouts()
    if layout is None:
        return default
    try:
        parsed = ScaleLayout(layout)  # type: ignore[arg-type]
    except ValueError:
        parsed = None
    if parsed not in allowed:
        raise invalid("layout", f"one of {', '.join(map(str, allowed))} for {dtype}", getattr(layout, "value", layout))
    return parsed  # type: ignore[return-value]


def global_scale_for(dtype: DispatchDtype, global_scale: object, device: torch.device) -> None:
    """A per-tensor scale only where the dtype has one: a one-element fp32 tensor on `device`."""
    if global_scale is None:
        return
    if not dtype.spec.global_scale:
        raise invalid("global_scale", f"None for {dtype} (it has no per-tensor scale)", "a tensor")
    if not isinstance(global_scale, torch.Tensor) or global_scale.numel() != 1:
        shape = tuple(global_scale.shape) if isinstance(global_scale, torch.Tensor) else global_scale
        raise invalid("global_scale", "a one-element fp32 tensor or None", shape)
    if global_scale.dtype != torch.float32:
        raise invalid("global_scale", "dtype torch.float32", global_scale.dtype)
    on_device("global_scale", global_scale, device)


def out_dtype(name: str, dtype: object) -> torch.dtype:
    """A float output dtype, or `InvalidInput`."""
    if dtype not in FLOAT_DTYPES:
        raise invalid(name, _FLOAT_NAMES, dtype)
    return dtype  # type: ignore[return-value]


def weight_layout(layout: object) -> ScaleLayout:
    """One of the weight layouts, or `InvalidInput`."""
    expected = "one of " + ", ".join(map(str, WEIGHT_LAYOUTS))
    try:
        parsed = ScaleLayout(layout)  # type: ignore[arg-type]
    except ValueError:
        raise invalid("layout", expected, layout) from None
    if parsed not in WEIGHT_LAYOUTS:
        raise invalid("layout", expected, parsed.value)
    return parsed


def float_weights(weight: object, layout: ScaleLayout, dtype: object) -> torch.Tensor:
    """Float expert weights `[E, K, N]` and a storage `dtype` that `layout` can take."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise invalid("dtype", "a torch.dtype or None", dtype)
    if not isinstance(weight, torch.Tensor):
        raise invalid("weight", "a torch.Tensor", type(weight).__name__)
    if weight.dtype not in FLOAT_DTYPES:
        raise invalid("weight", "a bf16, fp16 or fp32 tensor", weight.dtype)
    if weight.dim() != 3 or weight.shape[1] == 0 or weight.shape[2] == 0:
        raise invalid("weight", "3 dimensions [experts, K, N] with K > 0 and N > 0", tuple(weight.shape))
    if layout is ScaleLayout.NONE:
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise invalid("dtype", "bf16, fp16 or fp32 for unscaled weights", dtype)
        return weight
    choices = [s.weight_dtype for s in GEMM_KINDS.values() if s.weight_layout is layout]
    if dtype is not None and dtype not in choices:
        raise invalid("dtype", f"None or {' or '.join(map(str, choices))} for {layout} weights", dtype)
    if dtype == torch.quint4x2 and weight.shape[2] % INT4_PER_WORD:
        raise invalid("weight", f"N a multiple of {INT4_PER_WORD} for int4 per-channel weights", tuple(weight.shape))
    return weight


def gemm_operands(x: object, weight: object, groups: object) -> None:
    """The operand types and ranks of a grouped matmul (no values, no devices)."""
    if isinstance(x, (QuantizedTensor, PackedInt4Tensor)):
        if x.data.dim() != 2:
            raise invalid("x", "2-D data [M, K]", tuple(x.data.shape))
    elif isinstance(x, torch.Tensor):
        if x.dim() != 2:
            raise invalid("x", "a 2-D tensor [M, K]", tuple(x.shape))
    else:
        raise invalid("x", "a torch.Tensor, a QuantizedTensor or a PackedInt4Tensor", type(x).__name__)
    if not isinstance(weight, QuantizedWeight):
        raise invalid("weight", "a QuantizedWeight", type(weight).__name__)
    if not isinstance(groups, Groups):
        raise invalid("groups", "a hal Groups", type(groups).__name__)


def gemm_shapes(x: torch.Tensor | QuantizedTensor | PackedInt4Tensor, weight: QuantizedWeight, groups: Groups,
                limits: KernelLimits | None = None) -> tuple[int, int, int]:
    """Check K, the group count and `limits` (when given); return the logical `(M, K, N)`."""
    m, k = x.shape  # logical (unpacked) shapes throughout
    e, wk, n = weight.num_experts, weight.in_features, weight.out_features
    if k != wk:
        raise invalid("x, weight", "x [M, K] and weight [E, K, N] with the same K",
                      f"x {tuple(x.shape)} and weight {(e, wk, n)}")
    if groups.num_groups != e:
        raise invalid("groups", f"{e} groups (one per expert of weight)", groups.num_groups)
    if limits is not None:
        for name, limit, what, value in (("max_group_rows", limits.max_group_rows, "rows M", m),
                                         ("max_inner_dim", limits.max_inner_dim, "K", k),
                                         ("max_inner_dim", limits.max_inner_dim, "N", n),
                                         ("max_groups", limits.max_groups, "groups E", e)):
            if limit is not None and value > limit:
                raise invalid(f"grouped_matmul {what}", f"at most {limit} (kernel limit {name})", value)
    return m, k, n


def gemm_out_dtype(kind: GemmKind, requested: torch.dtype | None) -> torch.dtype:
    """The output dtype: as asked, else the kind's default (activation dtype, or bf16 when quantized)."""
    return out_dtype("out_dtype", kind.spec.default_out_dtype if requested is None else requested)


def swiglu_input(x: object) -> torch.Tensor:
    """A float tensor `[..., 2I]`."""
    if not isinstance(x, torch.Tensor):
        raise invalid("x", "a torch.Tensor", type(x).__name__)
    if x.dtype not in FLOAT_DTYPES:
        raise invalid("x", "a bf16, fp16 or fp32 tensor", x.dtype)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise invalid("x", "a last dimension of even size [..., 2I]", tuple(x.shape))
    return x


def activation_input(x: object, activation: Activation) -> torch.Tensor:
    """A float tensor `[..., 2I]` for a gated activation, `[..., I]` for a plain one."""
    if not isinstance(x, torch.Tensor):
        raise invalid("x", "a torch.Tensor", type(x).__name__)
    if x.dtype not in FLOAT_DTYPES:
        raise invalid("x", "a bf16, fp16 or fp32 tensor", x.dtype)
    if x.dim() < 1 or (activation.gated and x.shape[-1] % 2):
        raise invalid("x", f"a last dimension of even size [..., 2I] for {activation}", tuple(x.shape))
    return x


def expert_bias_operands(y: object, bias: object, groups: Groups) -> None:
    """`y` float `[M, N]`, `bias` float `[G, N]` with one row per group."""
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.dtype not in FLOAT_DTYPES:
        raise invalid("y", "a 2-D bf16/fp16/fp32 tensor [M, N]", _describe(y))
    if not isinstance(bias, torch.Tensor) or bias.dim() != 2 or bias.dtype not in FLOAT_DTYPES:
        raise invalid("bias", "a 2-D bf16/fp16/fp32 tensor [groups, N]", _describe(bias))
    if tuple(bias.shape) != (groups.num_groups, y.shape[1]):
        raise invalid("bias", f"shape ({groups.num_groups}, {y.shape[1]}) (one row per group)", tuple(bias.shape))


def _describe(t: object) -> str:
    return f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def expert_ids(topk_ids: object, num_experts: object) -> torch.Tensor:
    """Integer expert ids `[T, k]` and a positive expert count."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise invalid("topk_ids", "a 2-D integer tensor [T, k]", getattr(topk_ids, "shape", type(topk_ids).__name__))
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise invalid("topk_ids", "integer expert ids (int32 or int64)", topk_ids.dtype)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise invalid("num_experts", "a positive int", num_experts)
    return topk_ids


def combine_operands(rows: object, index: object, topk_weights: object) -> tuple[int, int]:
    """The combine's shapes (no values); return `(T, k)`."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise invalid("rows", "a 2-D tensor [R, H]", getattr(rows, "shape", type(rows).__name__))
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dim() != 2:
        raise invalid("topk_weights", "a 2-D tensor [T, k]",
                      getattr(topk_weights, "shape", type(topk_weights).__name__))
    t, k = topk_weights.shape
    pairs = t * k
    if index is None:
        if rows.shape[0] != pairs:
            raise invalid("rows", f"{pairs} rows (one per token and slot) when index is None", tuple(rows.shape))
    elif not isinstance(index, torch.Tensor) or index.dim() != 1 or index.numel() != pairs:
        raise invalid("index", f"a 1-D tensor of {pairs} row indices", getattr(index, "shape", type(index).__name__))
    return t, k
