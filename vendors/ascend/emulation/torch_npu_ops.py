"""CPU emulation of the torch_npu ops that moe-hal's Ascend vendor calls: the five compute ops
defined here and in `gmm` / `routing`, the storage-format pair (`npu_format`) and the MC2
expert-parallel pair (`mc2`, whose own docstring names its sources; its schema is 2.13's for
every modelled version).

Each method has the name and signature of the torch_npu op it stands for, computes the
result the op's documentation describes, and rejects the arguments the documentation
(or the op's meta registration) rejects, with a `RuntimeError` naming the op, the
parameter, what is allowed and what was given. Features the documentation lists but
this emulation does not compute raise `NotImplementedError` ("not emulated").

Sources: the op docstrings in torch_npu's `_op_plugin_docs.py` and the shape/dtype rules
in `op_plugin/meta/_meta_registrations.py` (torch-npu 2.13.0 wheel; 2.8.0 compared). The
argument lists (names, defaults, which keyword arguments exist) are those of one modelled
torch-npu version (`vendors.ascend.emulation.versions`): every public op binds its call
against that version's codegen schema before computing.

Numerics (assumption, everywhere): arithmetic in float32 (float64 for exact integer
matrix products), a single cast to the output dtype at the end, and `torch.round`
(half to even) for integer rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vendors.ascend.emulation import npu_format
from vendors.ascend.emulation.common import (
    err,
    dtype_name,
    tensor_arg,
    check_dtype,
    check_shape,
    quantize_rows,
    HALF,
    FLOAT,
    FP8_MAX,
    INT8_MAX,
    INT4_MAX,
    INT4_PER_WORD,
    SOC_PREFIXES,
)
from vendors.ascend.emulation.gmm import GroupedMatmulOps
from vendors.ascend.emulation.mc2 import Mc2Ops
from vendors.ascend.emulation.routing import RoutingOps
from vendors.ascend.emulation.versions import DEFAULT_VERSION, bind, check_version


class EmulatedTorchNpu(GroupedMatmulOps, RoutingOps, Mc2Ops):
    """The ops of torch_npu that moe-hal's Ascend vendor calls, emulated on the CPU for one SoC.

    `soc_name` is what the real `torch_npu.npu.get_device_name()` reports; it selects the
    generation, which decides generation-specific behaviour (float8 support on A5).
    `version` is the torch-npu version whose op schemas are modelled ("2.8", "2.10" or
    "2.13"): unknown keyword arguments are rejected and defaults are that version's.
    Inputs are tensors (normally on the CPU); outputs live on the inputs' device.
    """

    def __init__(self, soc_name: str = "Ascend910B3", version: str = DEFAULT_VERSION) -> None:
        if not isinstance(soc_name, str):
            raise RuntimeError(f"EmulatedTorchNpu: soc_name must be a str, got {type(soc_name).__name__}")
        self.version: str = check_version(version)
        for prefix, generation in SOC_PREFIXES:
            if soc_name.startswith(prefix):
                self.soc_name: str = soc_name
                self.generation: str = generation
                return
        supported = ", ".join(f"{p}* ({g})" for p, g in SOC_PREFIXES)
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
        x = tensor_arg(op, "x", x)
        check_dtype(op, "x", x, HALF)
        if x.dim() < 2:
            raise err(op, f"x must have at least 2 dims, got {x.dim()}")
        target, dtype_max = self._quant_target(op, dst_type)
        width = x.shape[-1]
        if target == torch.quint4x2 and width % INT4_PER_WORD:
            raise err(op, f"x's last dim must be divisible by 8 for dst_type quint4x2, got {width}")
        xf = x.to(torch.float32)
        if smooth_scales is not None:
            xf = xf * self._smooth_factors(op, x, smooth_scales, group_index)
        elif group_index is not None:
            raise err(op, "group_index requires smooth_scales, got smooth_scales=None")
        return quantize_rows(xf, dtype_max, target)

    def _quant_target(self, op: str, dst_type: object) -> tuple[torch.dtype, float]:
        allowed: dict[torch.dtype, float] = {torch.int8: INT8_MAX, torch.quint4x2: INT4_MAX}
        if self.generation == "A5":
            allowed.update(FP8_MAX)
        target = torch.int8 if dst_type is None else dst_type
        if not isinstance(target, torch.dtype) or target not in allowed:
            names = ", ".join(dtype_name(d) for d in allowed)
            raise err(
                op, f"dst_type on {self.soc_name} ({self.generation}) must be None or one of [{names}], got {dst_type}"
            )
        return target, allowed[target]

    def _smooth_factors(
        self, op: str, x: torch.Tensor, smooth: torch.Tensor, group_index: torch.Tensor | None
    ) -> torch.Tensor:
        """The per-element smoothing multipliers (float32, broadcastable to x)."""
        smooth = tensor_arg(op, "smooth_scales", smooth)
        width = x.shape[-1]
        if smooth.dtype != x.dtype:
            raise err(op, f"smooth_scales dtype must equal x's ({dtype_name(x.dtype)}), got {dtype_name(smooth.dtype)}")
        if group_index is None:
            check_shape(op, "smooth_scales (without group_index)", smooth, [width])
            return smooth.to(torch.float32)
        group_index = tensor_arg(op, "group_index", group_index)
        check_dtype(op, "group_index", group_index, (torch.int32,))
        if smooth.dim() != 2 or smooth.shape[1] != width:
            raise err(op, f"smooth_scales with group_index must be [G, {width}], got {list(smooth.shape)}")
        check_shape(op, "group_index", group_index, [smooth.shape[0]])
        rows = math.prod(x.shape[:-1])
        ends = group_index.tolist()
        if any(e < 0 for e in ends) or any(later < earlier for earlier, later in zip(ends, ends[1:])):
            raise err(op, f"group_index must be non-negative and non-decreasing, got {ends}")
        if not ends or ends[-1] != rows:
            raise err(op, f"group_index's last value must equal the row count {rows}, got {ends}")
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
        x = tensor_arg(op, "x", x)
        check_dtype(op, "x", x, FLOAT)
        if not 1 <= x.dim() <= 8:
            raise err(op, f"x must have 1 to 8 dims, got {x.dim()}")
        if not -x.dim() <= dim < x.dim():
            raise err(op, f"dim must be in [{-x.dim()}, {x.dim() - 1}], got {dim}")
        if x.shape[dim] % 2:
            raise err(op, f"x's size along dim {dim} must be even, got {x.shape[dim]}")
        gate, up = x.to(torch.float32).chunk(2, dim=dim)
        return (F.silu(gate) * up).to(x.dtype)


def _versioned(op: str, impl):  # type: ignore[no-untyped-def]
    """`op` bound against the instance's modelled schema, then computed by `impl`."""

    def call(self: EmulatedTorchNpu, *args, **kwargs):  # type: ignore[no-untyped-def]
        return impl(self, **bind(self.version, op, args, kwargs))

    call.__name__, call.__qualname__, call.__doc__ = op, f"EmulatedTorchNpu.{op}", impl.__doc__
    return call


for _op in (
    "npu_dynamic_quant",
    "npu_grouped_matmul",
    "npu_swiglu",
    "npu_moe_init_routing_v2",
    "npu_moe_finalize_routing",
):
    setattr(EmulatedTorchNpu, _op, _versioned(_op, getattr(EmulatedTorchNpu, _op)))

# Storage formats (FRACTAL_NZ), emulated as a tag: see `vendors.ascend.emulation.npu_format`.
EmulatedTorchNpu.npu_format_cast = npu_format.npu_format_cast  # type: ignore[attr-defined]
EmulatedTorchNpu.get_npu_format = npu_format.get_npu_format  # type: ignore[attr-defined]
