"""The torch_npu op schemas the emulation models, per torch-npu version.

Each modelled version lists, for every emulated op, its parameters in schema order: the
name, whether it is keyword-only, and its default (`REQUIRED` for none). They follow
`torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml` of the torch-npu wheel of that
version (2.8.0, 2.10.0 and 2.13.0 were read). A call is bound against the version's
schema: an argument the version does not have is rejected (`RuntimeError` naming the op
and the version), the version's defaults fill what the caller left out, and parameters
the emulation does not compute must keep their default.

Per version differences that matter to moe-hal (schema file of each wheel):
- `npu_moe_finalize_routing`: the trailing `k=1` exists only in 2.13.
- `npu_moe_init_routing_v2`: `quant_mode` defaults to 0 (static quantization) in 2.8 and
  to -1 in 2.10/2.13; `x_dtype` exists from 2.10. In 2.8 the meta function requires
  `active_expert_range` to be two ints, and (the reference notes, from the docs) `active_num`
  must be the pair count: the -1 default is modelled as valid only from 2.13.
- `npu_grouped_matmul`: `x_dtype`, `weight_dtype`, `scale_dtype`, `per_token_scale_dtype`
  exist from 2.10 (not emulated: only their default None).
- `npu_dynamic_quant`: `quant_mode="pertoken"` and `dst_type_max=0.0` exist from 2.10 (not
  emulated: only their defaults).
"""

from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import Any

REQUIRED = inspect.Parameter.empty
_POS, _KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY

#: The versions the emulation models, oldest first, and the one it uses unless told.
VERSIONS = ("2.8", "2.10", "2.13")
DEFAULT_VERSION = "2.13"
#: The variable `EmulatedAscendVendor` reads (from the environ mapping it is given, at
#: construction) to choose the modelled version; never written by moe-hal.
VERSION_VARIABLE = "MOE_HAL_EMULATED_TORCH_NPU"

_GMM_COMMON = (
    ("x", _POS, REQUIRED),
    ("weight", _POS, REQUIRED),
    ("bias", _KW, None),
    ("scale", _KW, None),
    ("offset", _KW, None),
    ("antiquant_scale", _KW, None),
    ("antiquant_offset", _KW, None),
    ("per_token_scale", _KW, None),
    ("group_list", _KW, None),
    ("activation_input", _KW, None),
    ("activation_quant_scale", _KW, None),
    ("activation_quant_offset", _KW, None),
    ("split_item", _KW, 0),
    ("group_type", _KW, None),
    ("group_list_type", _KW, 0),
    ("act_type", _KW, 0),
    ("tuning_config", _KW, None),
    ("output_dtype", _KW, None),
)
_GMM_DTYPES = (
    ("x_dtype", _KW, None),
    ("weight_dtype", _KW, None),
    ("scale_dtype", _KW, None),
    ("per_token_scale_dtype", _KW, None),
)
_DQ = (("x", _POS, REQUIRED), ("smooth_scales", _KW, None), ("group_index", _KW, None), ("dst_type", _KW, None))
_DQ_NEW = (("quant_mode", _KW, "pertoken"), ("dst_type_max", _KW, 0.0))
_FIN = (
    ("expanded_permuted_rows", _POS, REQUIRED),
    ("skip1", _POS, REQUIRED),
    ("skip2", _POS, REQUIRED),
    ("bias", _POS, REQUIRED),
    ("scales", _POS, REQUIRED),
    ("expanded_src_to_dst_row", _POS, REQUIRED),
    ("export_for_source_row", _POS, REQUIRED),
    ("drop_pad_mode", _POS, 0),
)


def _init_v2(quant_mode: int, x_dtype: bool) -> tuple[tuple[str, Any, Any], ...]:
    return (
        ("x", _POS, REQUIRED),
        ("expert_idx", _POS, REQUIRED),
        ("scale", _KW, None),
        ("offset", _KW, None),
        ("active_num", _KW, -1),
        ("expert_capacity", _KW, -1),
        ("expert_num", _KW, -1),
        ("drop_pad_mode", _KW, 0),
        ("expert_tokens_num_type", _KW, 0),
        ("expert_tokens_num_flag", _KW, False),
        ("quant_mode", _KW, quant_mode),
        ("active_expert_range", _KW, ()),
        ("row_idx_type", _KW, 0),
        *((("x_dtype", _KW, None),) if x_dtype else ()),
    )


_SWIGLU = (("x", _POS, REQUIRED), ("dim", _POS, -1))
_SCHEMAS = {
    "2.8": {
        "npu_grouped_matmul": _GMM_COMMON,
        "npu_dynamic_quant": _DQ,
        "npu_swiglu": _SWIGLU,
        "npu_moe_init_routing_v2": _init_v2(0, False),
        "npu_moe_finalize_routing": _FIN,
    },
    "2.10": {
        "npu_grouped_matmul": _GMM_COMMON + _GMM_DTYPES,
        "npu_dynamic_quant": _DQ + _DQ_NEW,
        "npu_swiglu": _SWIGLU,
        "npu_moe_init_routing_v2": _init_v2(-1, True),
        "npu_moe_finalize_routing": _FIN,
    },
    "2.13": {
        "npu_grouped_matmul": _GMM_COMMON + _GMM_DTYPES,
        "npu_dynamic_quant": _DQ + _DQ_NEW,
        "npu_swiglu": _SWIGLU,
        "npu_moe_init_routing_v2": _init_v2(-1, True),
        "npu_moe_finalize_routing": _FIN + (("k", _POS, 1),),
    },
}
#: Parameters that exist in some version but that the emulation does not compute: only
#: their default is accepted, and they are not passed on.
NOT_EMULATED = frozenset(
    {"x_dtype", "weight_dtype", "scale_dtype", "per_token_scale_dtype", "quant_mode@dq", "dst_type_max"}
)


def _signature(params: tuple[tuple[str, Any, Any], ...]) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(name, kind, default=default) for name, kind, default in params])


SIGNATURES = MappingProxyType(
    {v: MappingProxyType({op: _signature(p) for op, p in ops.items()}) for v, ops in _SCHEMAS.items()}
)


def check_version(version: object) -> str:
    """The modelled version named by `version` ("2.8", "2.8.0", ...), or a RuntimeError listing them."""
    text = str(version).strip()
    parts = text.split(".")
    short = ".".join(parts[:2]) if len(parts) >= 2 and all(p.isdigit() for p in parts[2:]) else text
    if short not in _SCHEMAS:
        raise RuntimeError(f"torch_npu emulation: version {text!r} is not modelled; modelled: {', '.join(VERSIONS)}")
    return short


def bind(version: str, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of `op` in `version`'s schema, by name, defaults applied; the parameters
    the emulation does not compute are checked to be at their default and dropped."""
    signature = SIGNATURES[version][op]
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise RuntimeError(
            f"{op} (torch_npu {version} schema): {exc}; its parameters: {', '.join(signature.parameters)}"
        ) from None
    bound.apply_defaults()
    values = dict(bound.arguments)
    for name in list(values):
        key = f"{name}@dq" if op == "npu_dynamic_quant" and name == "quant_mode" else name
        if key in NOT_EMULATED:
            if values[name] != signature.parameters[name].default:
                raise NotImplementedError(f"{op}: {name}={values[name]!r} is not emulated; only its default")
            del values[name]
    return values
