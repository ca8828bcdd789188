"""The names the `hal` command's help lists, without importing the tables (and torch) they come from.

`tests/cli/test_cli_starts_without_torch.py` checks them against `hal.KNOWN_SCHEMES` and `hal.DispatchDtype`,
so that a misspelt name is refused before torch is imported and every accepted one still reaches the parser.
"""

#: The quant schemes' names (`hal.KNOWN_SCHEMES`).
SCHEME_NAMES = (
    "unquantized",
    "w8a8-int8",
    "w8a8-fp8-block",
    "w8a8-fp8",
    "w4a4-int4",
    "w4a16-mxfp4",
    "w4a16-nvfp4",
    "nvfp4",
)
#: The dispatch dtypes' canonical names, `auto` included (`hal.DispatchDtype.names()`).
DISPATCH_DTYPE_NAMES = ("bf16", "fp8", "int8", "nvfp4", "fp16", "fp32", "auto")
#: Every spelling `hal.DispatchDtype.parse` accepts (lower case, `_` for `-`).
DISPATCH_DTYPE_SPELLINGS = frozenset(
    {
        *("auto", "bf16", "bfloat16", "e4m3", "float", "float16", "float32", "float8_e4m3fn"),
        *("fp16", "fp32", "fp8", "fp8_e4m3", "half", "int8", "nvfp4"),
    }
)
#: Every spelling `hal.parse_scheme` accepts (lower case, `-` for `_`): the names, their aliases, and the
#: float dtypes that mean the unquantized scheme over weights of that dtype.
SCHEME_SPELLINGS = frozenset(
    {
        *SCHEME_NAMES,
        *("none", "bf16", "int8", "fp8", "int4", "fp8-rowwise", "mxfp4"),
        *("bfloat16", "float", "float16", "float32", "fp16", "fp32", "half"),
    }
)


def known_dispatch_dtype(value: str) -> bool:
    """Whether `hal.DispatchDtype.parse` would accept `value` (checked without importing torch)."""
    return value.strip().lower().replace("-", "_") in DISPATCH_DTYPE_SPELLINGS


def known_scheme(value: str) -> bool:
    """Whether `hal.parse_scheme` would accept `value` (checked without importing torch)."""
    return value.strip().lower().replace("_", "-") in SCHEME_SPELLINGS
