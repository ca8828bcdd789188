"""What a layer's stored tensors must be, checked once when they are loaded (never per forward).

`STORED_LAYOUTS` is the table: for each weight layout, the tensors one projection's weight
`[E, K, N]` is stored as (`weight`, and `scale` / `global_scale` where the layout has them),
with their shapes and dtypes. A weight store's state (`experts.*`, `shared_experts.store.*`)
is checked against the entries of its layer's scheme, and every value loaded must be finite,
so that a refused state names its key and what was expected, and a state that fits is the
layer it claims to be (never another layer of another intermediate size). A new weight format
is one row of the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from hal import (
    FLOAT_DTYPES,
    FP8_GROUP_SIZE,
    FP32_MAX,
    FP32_TINY,
    INT4_PER_WORD,
    MXFP4_BLOCK_SIZE,
    NVFP4_BLOCK_SIZE,
    GemmSpec,
    HalError,
    InvalidInput,
    QuantizedWeight,
    ScaleLayout,
    refuse_non_finite,
)

Shapes = Callable[[int, int, int], list[tuple[int, ...]]]


@dataclass(frozen=True)
class Expected:
    """The shapes and dtypes one stored tensor may have."""

    shapes: list[tuple[int, ...]]
    dtypes: tuple[torch.dtype, ...]

    def problem(self, key: str, t: object) -> str | None:
        """What is wrong with `t` as this tensor (key, expected vs found), or None."""
        want = (
            f"{'/'.join(dtype_name(d) for d in self.dtypes)} of shape {' or '.join(str(list(s)) for s in self.shapes)}"
        )
        if not isinstance(t, torch.Tensor):
            return f"{key}: expected {want}, got {type(t).__name__}"
        if tuple(t.shape) not in self.shapes or t.dtype not in self.dtypes:
            return f"{key}: expected {want}, got {dtype_name(t.dtype)} of shape {list(t.shape)}"
        return None


@dataclass(frozen=True)
class StoredLayout:
    """How a projection's weight `[E, K, N]` of one layout is stored beside its data: the scale's shapes and
    dtype (None: no scale), the global scale's shapes (None: none), values packed per byte along K, whether
    the scale holds e8m0 bytes (byte 255 is NaN)."""

    scale: Shapes | None = None
    scale_dtype: torch.dtype = torch.float32
    global_scale: Shapes | None = None
    values_per_byte_k: int = 1
    scale_e8m0: bool = False


#: The stored tensors of each weight layout (`hal.formats` defines the layouts).
STORED_LAYOUTS: dict[ScaleLayout, StoredLayout] = {
    ScaleLayout.NONE: StoredLayout(),
    ScaleLayout.PER_CHANNEL: StoredLayout(scale=lambda e, k, n: [(e, n)]),
    ScaleLayout.BLOCK_128X128: StoredLayout(
        scale=lambda e, k, n: [(e, math.ceil(k / FP8_GROUP_SIZE), math.ceil(n / FP8_GROUP_SIZE))]
    ),
    ScaleLayout.BLOCK_16: StoredLayout(
        scale=lambda e, k, n: [(e, k // NVFP4_BLOCK_SIZE, n)],
        scale_dtype=torch.float8_e4m3fn,
        global_scale=lambda e, k, n: [(e,), (e, n)],
        values_per_byte_k=2,
    ),
    ScaleLayout.BLOCK_32: StoredLayout(
        scale=lambda e, k, n: [(e, k // MXFP4_BLOCK_SIZE, n)],
        scale_dtype=torch.uint8,
        values_per_byte_k=2,
        scale_e8m0=True,
    ),
}
#: Storage dtypes that pack several values along N (int4: eight per int32 word).
_PACKED_N = {torch.int32: INT4_PER_WORD}


def projection_tensors(name: str, kind: GemmSpec, e: int, k: int, n: int) -> dict[str, Expected]:
    """The stored tensors (`{name}_weight`, `{name}_scale`, ...) of a projection `[E, K, N]` of `kind`."""
    stored = STORED_LAYOUTS[kind.weight_layout]
    data = (e, k // stored.values_per_byte_k, n // _PACKED_N.get(kind.weight_storage, 1))
    found = {f"{name}_weight": Expected([data], (kind.weight_storage,))}
    if stored.scale is not None:
        found[f"{name}_scale"] = Expected(stored.scale(e, k, n), (stored.scale_dtype,))
    if stored.global_scale is not None:
        found[f"{name}_global_scale"] = Expected(stored.global_scale(e, k, n), (torch.float32,))
    return found


def store_tensors(
    kind: GemmSpec, experts: int, hidden: int, width: int, intermediate: int, *, bias: bool
) -> dict[str, Expected]:
    """Every tensor a weight store of `experts` experts holds: `w13` `[E, H, W]`, `w2` `[E, I, H]`, fp32
    biases when `bias`, and the activations' fp32 global scales where the weights have global scales (and the
    activations are quantized: not for a weight-only kind)."""
    found = {
        **projection_tensors("w13", kind, experts, hidden, width),
        **projection_tensors("w2", kind, experts, intermediate, hidden),
    }
    if bias:
        found["w13_bias"] = Expected([(experts, width)], (torch.float32,))
        found["w2_bias"] = Expected([(experts, hidden)], (torch.float32,))
    if STORED_LAYOUTS[kind.weight_layout].global_scale is not None and not kind.weight_only:
        for name in ("input_global_scale", "intermediate_global_scale"):
            found[name] = Expected([(1,)], (torch.float32,))
    return found


def state_problems(
    state: Mapping[str, object], prefix: str, expected: Mapping[str, Expected], known: frozenset[str]
) -> list[str]:
    """What keeps the tensors of `state` under `prefix` (a weight store's) from being the `expected` ones:
    a missing or an unexpected tensor (of the store's `known` names), a wrong shape or dtype. Nothing when
    the state holds none of the store's tensors (it is then not loaded)."""
    given = {
        key[len(prefix) :]: t for key, t in state.items() if key.startswith(prefix) and "." not in key[len(prefix) :]
    }
    if not any(name in known for name in given):
        return []
    problems = [f"{prefix}{name}: expected this tensor, got none" for name in expected if name not in given]
    problems += [
        f"{prefix}{name}: expected no such tensor in this layer's format, got one"
        for name in given
        if name in known and name not in expected
    ]
    problems += [p for name, e in expected.items() if name in given and (p := e.problem(prefix + name, given[name]))]
    return problems


def e8m0_tensors(kind: GemmSpec) -> frozenset[str]:
    """The stored tensors of `kind`'s weights holding e8m0 bytes (mxfp4's scales), whose byte 255 is NaN."""
    return frozenset({"w13_scale", "w2_scale"}) if STORED_LAYOUTS[kind.weight_layout].scale_e8m0 else frozenset()


def non_finite_problems(state: Mapping[str, object], prefix: str, e8m0: frozenset[str] = frozenset()) -> list[str]:
    """The tensors under `prefix` holding inf or NaN (each named by its key); those whose last name is in
    `e8m0` hold e8m0 bytes."""
    problems = []
    for key, t in state.items():
        if key.startswith(prefix) and isinstance(t, torch.Tensor) and not t.is_meta:
            try:
                refuse_non_finite(key, t, e8m0=key.rsplit(".", 1)[-1] in e8m0)
                if key.endswith("global_scale"):
                    refuse_bad_global_scale(key, t)
                elif key.endswith("_scale"):
                    refuse_negative_scales(key, t)
            except HalError as exc:
                problems.append(str(exc))
    return problems


def refuse_negative_scales(name: str, t: torch.Tensor) -> None:
    """`InvalidInput` naming `name` when the float scales `t` hold a negative value (a scale is a magnitude:
    a negative one flips its block's signs; zero, an all-zero block's scale, is kept). e8m0 bytes have no sign."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    negative = (t.float() if t.element_size() == 1 else t) < 0  # fp8 scales compare after a widening
    if bool(negative.any()):
        first = float(t[negative].flatten()[0].float())
        raise InvalidInput(
            f"{name}: expected non-negative scales, got {int(negative.sum())} negative (e.g. {first:.6g})"
        )


def refuse_bad_global_scale(name: str, t: torch.Tensor) -> None:
    """`InvalidInput` naming `name` unless every value of the fp32 global scale `t` is positive and normal
    (zero, negative or subnormal scales turn the dequantized values into inf, NaN or flipped signs)."""
    outside = ~((t >= FP32_TINY) & (t <= FP32_MAX))
    if bool(outside.any()):
        bad = t[outside]
        raise InvalidInput(
            f"{name}: expected positive global scales in [{FP32_TINY:.6g}, {FP32_MAX:.6g}], "
            f"got {bad.numel()} outside (e.g. {float(bad.flatten()[0]):.6g})"
        )


def refuse_non_finite_weights(what: str, weights: object) -> None:
    """`InvalidInput` naming the first tensor of `weights` (a `moe.ExpertWeights`) holding inf or NaN:
    `{what}.w13.scale`, `{what}.w2_bias`, ..."""
    for field in ("w13", "w2"):
        w: QuantizedWeight = getattr(weights, field)
        e8m0 = STORED_LAYOUTS[w.layout].scale_e8m0 if w.layout in STORED_LAYOUTS else False
        for part, t in w.tensors().items():
            refuse_non_finite(f"{what}.{field}.{part}", t, e8m0=e8m0 and part == "scale")
            if part == "global_scale":
                refuse_bad_global_scale(f"{what}.{field}.{part}", t)
            elif part == "scale":
                refuse_negative_scales(f"{what}.{field}.{part}", t)
    for field in ("w13_bias", "w2_bias", "input_global_scale", "intermediate_global_scale"):
        t = getattr(weights, field)
        if isinstance(t, torch.Tensor):
            refuse_non_finite(f"{what}.{field}", t)
            if field.endswith("global_scale"):
                refuse_bad_global_scale(f"{what}.{field}", t)


def float_tensor(name: str, t: object, shapes: list[tuple[int, ...]]) -> str | None:
    """The problem with `t` as a float tensor of one of `shapes` (key, expected vs found), or None."""
    return Expected(shapes, FLOAT_DTYPES).problem(name, t)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`, for messages."""
    return str(dtype).removeprefix("torch.")
