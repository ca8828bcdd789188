"""The names the `hal` command's help lists, without importing the tables (and torch) they come from.

`tests/cli/test_cli_starts_without_torch.py` checks them against `hal.KNOWN_SCHEMES` and `hal.DispatchDtype`.
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
