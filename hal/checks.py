"""The argument checks of hal's ops, made once for every vendor by `hal.Vendor`.

Only what can be seen without reading device values: types, dtypes, shapes, devices,
kernel limits. Value checks (finite inputs, group lists that add up) would cost a host
synchronisation on an accelerator; implementations that can afford them make them. The
index ranges of the permutation ops are checked here where reading them is free: on a
vendor that runs in step with the host (`Capabilities.host_synchronous`) or on tensors in
host memory (`values_are_free`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hal.activations import Activation
from hal.capabilities import KernelLimits
from hal.dtypes import FLOAT_DTYPES, INT4_PER_WORD, WEIGHT_LAYOUT_ALIASES, WEIGHT_LAYOUTS, DispatchDtype, ScaleLayout
from hal.errors import InvalidInput, invalid, positive_int
from hal.formats import PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from hal.gemm_kinds import GEMM_KINDS, GemmKind
from hal.groups import GroupListKind, Groups

_FLOAT_NAMES = "torch.bfloat16, torch.float16 or torch.float32"
#: dtypes of expert ids and row indices (both give identical results on every vendor)
INDEX_DTYPES = (torch.int32, torch.int64)
#: dtypes routing weights may come in (they are read in fp32)
ROUTING_WEIGHT_DTYPES = (*FLOAT_DTYPES, torch.float64)


def on_device(name: str, t: object, device: torch.device) -> None:
    """Raise `InvalidInput` unless `t` (when a tensor) is on `device` (an index-less device matches any index)."""
    if not isinstance(t, torch.Tensor):
        return
    given = t.device
    if given == device:  # the common case, decided in one comparison
        return
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


def concrete_dtype(dtype: object, name: str = "dtype") -> DispatchDtype:
    """A dispatch dtype other than `auto`, or `InvalidInput` naming the argument `name`."""
    parsed = dispatch_dtype(name, dtype, concrete=True)
    if parsed is DispatchDtype.AUTO:
        names = ", ".join(d.value for d in DispatchDtype.concrete())
        raise invalid(name, f"a concrete dispatch dtype ({names})", "auto")
    return parsed


def dispatch_dtype(name: str, dtype: object, *, concrete: bool = False) -> DispatchDtype:
    """A `DispatchDtype` or its name, parsed, or `InvalidInput` naming the argument `name` (and
    listing the concrete dtypes, or all of them with `auto`)."""
    if isinstance(dtype, DispatchDtype):
        return dtype
    try:
        return DispatchDtype.parse(dtype)  # type: ignore[arg-type]
    except InvalidInput:
        names = [d.value for d in DispatchDtype.concrete()] if concrete else DispatchDtype.names()
        raise invalid(name, f"a dispatch dtype ({', '.join(names)})", dtype) from None


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
    """A float output dtype (a `torch.dtype`: bf16, fp16 or fp32), or `InvalidInput`; never a
    string and never an integer dtype (a cast to one would silently wrap around)."""
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise invalid(name, _FLOAT_NAMES, dtype)
    return dtype  # type: ignore[return-value]


def weight_layout(layout: object) -> ScaleLayout:
    """One of the weight layouts (or its format's name: `"mxfp4"`, `"nvfp4"`), or `InvalidInput`."""
    expected = "one of " + ", ".join(map(str, WEIGHT_LAYOUTS)) + " (or " + ", ".join(WEIGHT_LAYOUT_ALIASES) + ")"
    if isinstance(layout, str) and layout.strip().lower() in WEIGHT_LAYOUT_ALIASES:
        return WEIGHT_LAYOUT_ALIASES[layout.strip().lower()]
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
    choices = list(dict.fromkeys(s.weight_dtype for s in GEMM_KINDS.values() if s.weight_layout is layout))
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


def gemm_shapes(
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
    weight: QuantizedWeight,
    groups: Groups,
    limits: KernelLimits | None = None,
    *,
    rows: int | None = None,
) -> tuple[int, int, int]:
    """Check K, the group count and `limits` (when given); return the logical `(M, K, N)`
    (`rows`: M when the product reads x through a row index)."""
    m, k = x.shape  # logical (unpacked) shapes throughout
    if rows is not None:
        m = rows
    e, wk, n = weight.num_experts, weight.in_features, weight.out_features
    if k != wk:
        raise invalid(
            "x, weight", "x [M, K] and weight [E, K, N] with the same K", f"x {tuple(x.shape)} and weight {(e, wk, n)}"
        )
    if groups.num_groups != e:
        raise invalid("groups", f"{e} groups (one per expert of weight)", groups.num_groups)
    if limits is not None:
        for name, limit, what, value in (
            ("max_group_rows", limits.max_group_rows, "rows M", m),
            ("max_inner_dim", limits.max_inner_dim, "K", k),
            ("max_inner_dim", limits.max_inner_dim, "N", n),
            ("max_groups", limits.max_groups, "groups E", e),
        ):
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
    if x.dim() < 1:
        raise invalid("x", f"at least one dimension for {activation}", tuple(x.shape))
    if activation.gated and x.shape[-1] % 2:
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


def values_are_free(host_synchronous: bool, *tensors: object) -> bool:
    """Whether reading the values of `tensors` costs no device synchronisation: the vendor runs in
    step with the host, or every tensor given is in host memory."""
    return host_synchronous or all(t.is_cpu for t in tensors if isinstance(t, torch.Tensor))


def index_range(name: str, t: torch.Tensor, bound: int, what: str) -> None:
    """Every value of the integer tensor `t` in `[0, bound)`, or `InvalidInput` (reads the values)."""
    if t.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(t))
    if low < 0 or high >= bound:
        raise invalid(name, f"{what} in [0, {bound})", f"values in [{low}, {high}]")


def router_logits(logits: object, top_k: object) -> torch.Tensor:
    """Float logits `[T, E]` (bf16, fp16, fp32 or float64) and an int `top_k` in `[1, E]`."""
    if not isinstance(logits, torch.Tensor):
        raise invalid("logits", "a torch.Tensor", type(logits).__name__)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise invalid("logits", "a [tokens, experts] tensor with at least one expert", tuple(logits.shape))
    if logits.dtype not in ROUTING_WEIGHT_DTYPES:
        raise invalid("logits", "a bf16, fp16, fp32 or float64 tensor", logits.dtype)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= logits.shape[1]:
        raise invalid("top_k", f"an int in [1, {logits.shape[1]}] (the experts)", top_k)
    return logits


def expert_ids(topk_ids: object, num_experts: object, *, host_synchronous: bool = False) -> torch.Tensor:
    """Expert ids `[T, k]` (int32 or int64) and `num_experts` a positive int; the ids' range
    `[0, num_experts)` too where reading them is free (`values_are_free`)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise invalid("topk_ids", "a 2-D int32/int64 tensor [T, k]", _describe(topk_ids))
    if topk_ids.dtype not in INDEX_DTYPES:
        raise invalid("topk_ids", "integer expert ids (int32 or int64)", topk_ids.dtype)
    experts = positive_int("num_experts", num_experts)
    if values_are_free(host_synchronous, topk_ids):
        index_range("topk_ids", topk_ids, experts, "expert ids")
    return topk_ids


def row_index(index: object, source_rows: int, *, host_synchronous: bool = False) -> None:
    """A grouped matmul's `row_index`: int32/int64 `[M]`, its range `[0, source_rows)` where reading it is free."""
    if not isinstance(index, torch.Tensor) or index.dim() != 1:
        raise invalid("row_index", "None or a 1-D int32/int64 tensor of row indices into x", _describe(index))
    if index.dtype not in INDEX_DTYPES:
        raise invalid("row_index", "int32 or int64 row indices", index.dtype)
    if values_are_free(host_synchronous, index):
        index_range("row_index", index, source_rows, "rows of x")


def combine_operands(
    rows: object, index: object, topk_weights: object, *, host_synchronous: bool = False
) -> tuple[int, int]:
    """The combine's operands: `rows` float `[R, H]`, `topk_weights` float `[T, k]`, `index` None
    (R = T*k) or int32/int64 `[T*k]`, its range `[0, R)` where reading it is free; return `(T, k)`."""
    rows_and_weights(rows, topk_weights)
    t, k = topk_weights.shape  # type: ignore[union-attr]
    pairs = t * k
    if index is None:
        if rows.shape[0] != pairs:  # type: ignore[union-attr]
            raise invalid(
                "rows",
                f"{pairs} rows (one per token and slot) when index is None",
                tuple(rows.shape),  # type: ignore[union-attr]
            )
        return t, k
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.numel() != pairs:
        raise invalid("index", f"None or a 1-D int32/int64 tensor of {pairs} row indices", _describe(index))
    if index.dtype not in INDEX_DTYPES:
        raise invalid("index", "int32 or int64 row indices", index.dtype)
    if values_are_free(host_synchronous, index):
        index_range("index", index, rows.shape[0], "row indices")  # type: ignore[union-attr]
    return t, k


def rows_and_weights(rows: object, topk_weights: object) -> None:
    """Rows to combine, bf16/fp16/fp32 `[R, H]`, and their routing weights, floating-point `[T, k]`."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.dtype not in FLOAT_DTYPES:
        raise invalid("rows", "a 2-D bf16/fp16/fp32 tensor [R, H]", _describe(rows))
    if (
        not isinstance(topk_weights, torch.Tensor)
        or topk_weights.dim() != 2
        or topk_weights.dtype not in ROUTING_WEIGHT_DTYPES
    ):
        raise invalid("topk_weights", "a 2-D floating-point tensor [T, k]", _describe(topk_weights))


def name_string(name: str, value: object, what: str) -> str:
    """`value` if it is a `str` (a scheme or dispatcher name), else `InvalidInput`."""
    if not isinstance(value, str):
        raise invalid(name, what, value)
    return value


def optional_positive_int(name: str, value: object) -> int | None:
    """None or a positive int (not a bool), else `InvalidInput`."""
    return None if value is None else positive_int(name, value, "None or a positive int")


def fused_operands(hidden_states: object, topk_ids: object, topk_weights: object, w13: object, w2: object) -> None:
    """The fused op's operand types and shapes: float `[T, H]` rows, int32/int64 ids and float weights
    `[T, k]`, and two `QuantizedWeight`s chaining `H -> 2I -> H` (w13 `[E, H, 2I]`, w2 `[E, I, H]`)."""
    if (
        not isinstance(hidden_states, torch.Tensor)
        or hidden_states.dim() != 2
        or hidden_states.dtype not in FLOAT_DTYPES
    ):
        raise invalid("hidden_states", "a 2-D bf16/fp16/fp32 tensor [T, H]", _describe(hidden_states))
    t, h = hidden_states.shape
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise invalid("topk_ids", f"a 2-D tensor [{t}, k]", _describe(topk_ids))
    if topk_ids.dtype not in INDEX_DTYPES:
        raise invalid("topk_ids", "integer expert ids (int32 or int64)", topk_ids.dtype)
    if (
        not isinstance(topk_weights, torch.Tensor)
        or tuple(topk_weights.shape) != tuple(topk_ids.shape)
        or topk_weights.dtype not in ROUTING_WEIGHT_DTYPES
    ):
        raise invalid(
            "topk_weights",
            f"a floating-point tensor of the shape of topk_ids {tuple(topk_ids.shape)}",
            _describe(topk_weights),
        )
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, QuantizedWeight):
            raise invalid(name, "a hal.QuantizedWeight", type(w).__name__)
    first = (w13.num_experts, w13.in_features, w13.out_features)  # type: ignore[union-attr]
    second = (w2.num_experts, w2.in_features, w2.out_features)  # type: ignore[union-attr]
    e, wh, two_i = first
    if wh != h or two_i % 2 or second != (e, two_i // 2, h):
        raise invalid("w13, w2", f"w13 [E, {h}, 2I] and w2 [E, I, {h}]", f"{first} and {second}")


_ENVIRON = "a mapping of str to str (such as os.environ) or None"


def environ_mapping(environ: object) -> Mapping[str, str] | None:
    """`environ` if it is None or a mapping of str to str (every entry checked, not only those read,
    so a wrong mapping fails at once), else `InvalidInput` naming `environ`."""
    if environ is None:
        return None
    if not isinstance(environ, Mapping):
        raise invalid("environ", _ENVIRON, type(environ).__name__)
    for key, value in environ.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise invalid("environ", _ENVIRON, f"the entry {key!r}: {value!r}")
    return environ


def group_values(groups: Groups, rows: int, *, padding: bool) -> None:
    """The numbers of a group list against the `rows` of the operand (reads them: only where that is
    free): counts non-negative, offsets non-negative and non-decreasing, and at most `rows` covered (rows
    beyond the groups are unspecified on every vendor; `padding` is kept for callers), or `InvalidInput`."""
    values = [int(v) for v in groups.tensor.tolist()]
    if groups.kind is GroupListKind.COUNTS:
        if any(v < 0 for v in values):
            raise invalid("groups", "non-negative counts", values)
        total = sum(values)
    else:
        if any(v < 0 for v in values) or any(b < a for a, b in zip(values, values[1:])):
            raise invalid("groups", "non-negative, non-decreasing offsets", values)
        total = values[-1]
    del padding  # rows beyond the groups are unspecified on every vendor (expert-parallel buffers have spare rows)
    if total > rows:
        raise invalid(
            "groups", f"groups covering at most the {rows} rows of x ({groups.kind})", f"{total} rows in {values}"
        )


def process_group(value: object, *, optional: bool) -> None:
    """`value` a `torch.distributed.ProcessGroup` (or None where `optional`), else `InvalidInput`: a type
    check only, so a wrong object never reaches a vendor's communication library."""
    import torch.distributed as dist

    if value is None and optional:
        return
    if not (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        what = "a torch.distributed ProcessGroup" + (" or None" if optional else "")
        raise invalid("process_group", what, type(value).__name__)
