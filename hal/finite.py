"""The one check that values are finite, for every dtype a weight, scale or activation is held in.

Reading values costs a host synchronisation on an accelerator, so this runs where the values
are read anyway or once: when something is loaded or quantized, never per forward. Integer
and packed (uint8) tensors hold no inf or NaN and pass without being read, except e8m0 scale bytes
(mxfp4), whose byte 255 is NaN.
"""

from __future__ import annotations

import torch

from hal.dtypes import E8M0_NAN
from hal.errors import InvalidInput

#: Elements tested at a time (bounds the memory the masks take).
_CHUNK = 1 << 24
#: e4m3fn has no inf; its only non-finite codes are NaN, all exponent and mantissa bits set.
_E4M3FN_NAN = 0x7F


def non_finite_count(x: torch.Tensor, *, e8m0: bool = False) -> int:
    """How many values of `x` are inf or NaN (0 for integer and packed tensors); `e8m0`: `x` holds e8m0
    bytes (uint8 biased exponents), of which 255 is NaN. A tensor without storage (the meta device) has no
    values: 0."""
    if x.is_meta:
        return 0
    if e8m0:
        return int((x == E8M0_NAN).sum())
    if not (torch.is_floating_point(x) or x.is_complex()) or x.numel() == 0:
        return 0
    if x.dim() > 1 and x.numel() > _CHUNK:  # slice by slice: the masks stay small for a model's weights
        return sum(non_finite_count(part) for part in x)
    if x.dtype == torch.float8_e4m3fn:
        return int(((x.view(torch.uint8) & _E4M3FN_NAN) == _E4M3FN_NAN).sum())
    if x.element_size() == 1:  # other float8 formats: widened in chunks
        flat = x.reshape(-1)
        return sum(
            int((~torch.isfinite(flat[i : i + _CHUNK].to(torch.float32))).sum()) for i in range(0, flat.numel(), _CHUNK)
        )
    finite = torch.isfinite(x)
    return 0 if bool(finite.all()) else int((~finite).sum())


def refuse_non_finite(name: str, x: torch.Tensor, *, e8m0: bool = False) -> torch.Tensor:
    """`x` unless a value is inf or NaN, else `InvalidInput` naming `name` (a scale made from one, or a
    weight holding one, poisons whole output rows); reads the values. `e8m0`: `x` holds e8m0 scale bytes.
    A tensor on the meta device (a model built without storage) has no values to read and passes."""
    if not isinstance(x, torch.Tensor):
        raise InvalidInput(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    bad = non_finite_count(x, e8m0=e8m0)
    if bad:
        raise InvalidInput(f"{name}: expected finite values, got {bad} non-finite (inf/NaN) value(s)")
    return x
