"""Corruptions of valid tensors (a checkpoint's, a state dict's), drawn by hypothesis: what the loading
properties feed a loader to check that it refuses them (or computes them correctly)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import strategies as st

#: The kinds of corruption drawn.
CORRUPTIONS = ("nan", "inf", "shape", "dtype", "missing", "extra", "truncate")
#: The dtypes a tensor may be cast to.
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8, torch.uint8)


def corrupted(
    tensors: dict[str, torch.Tensor], data: st.DataObject, extra_name: Callable[[str], str]
) -> tuple[str, dict[str, torch.Tensor]]:
    """`tensors` with one corruption drawn from `data` (the tensors given are not changed) and its kind;
    `extra_name(key)` names a tensor no loader understands, beside `key`."""
    out = dict(tensors)
    kind = data.draw(st.sampled_from(CORRUPTIONS), label="corruption")
    scales = sorted(k for k, t in out.items() if "scale" in k and t.numel() > 1)
    #: floating tensors and mxfp4's e8m0 scale bytes (uint8, 255 is NaN)
    floats = sorted(k for k, t in out.items() if torch.is_floating_point(t) or (k in scales and t.dtype == torch.uint8))
    if kind in ("nan", "inf") and floats:
        key = data.draw(st.sampled_from(floats), label="key")
        t = out[key].clone()
        at = data.draw(st.integers(0, t.numel() - 1), label="index")
        if t.dtype == torch.uint8:  # an e8m0 byte: 255 is its one non-finite code
            t.reshape(-1)[at] = 255
        elif t.dtype == torch.float8_e4m3fn:  # e4m3 has no inf: its non-finite code is NaN
            t.view(torch.uint8).reshape(-1)[at] = 0x7F
        else:
            t.reshape(-1)[at] = float(kind)
        out[key] = t
    elif kind == "shape":
        key = data.draw(st.sampled_from(sorted(out)), label="key")
        t = out[key]
        if t.dim() == 0:
            out[key] = t.reshape(1, 1)
        else:
            dim = data.draw(st.integers(0, t.dim() - 1), label="dim")
            grown = torch.cat([t, t.narrow(dim, 0, 1)], dim=dim)
            out[key] = t.narrow(dim, 0, t.shape[dim] - 1) if t.shape[dim] > 1 and data.draw(st.booleans()) else grown
    elif kind == "dtype":
        key = data.draw(st.sampled_from(sorted(out)), label="key")
        dtype = data.draw(st.sampled_from([d for d in DTYPES if d != out[key].dtype]), label="dtype")
        value = out[key].to(torch.float32)
        out[key] = (
            value.clamp(-448, 448).to(dtype) if dtype.is_floating_point else value.round().clamp(0, 127).to(dtype)
        )
    elif kind == "missing":
        del out[data.draw(st.sampled_from(sorted(out)), label="key")]
    elif kind == "extra":
        key = data.draw(st.sampled_from(sorted(out)), label="key")
        out[extra_name(key)] = torch.zeros(out[key].shape[-1:], dtype=torch.int8)
    elif scales:  # truncate: a scale one value short
        key = data.draw(st.sampled_from(scales), label="key")
        out[key] = out[key].reshape(-1)[:-1]
    return kind, out
