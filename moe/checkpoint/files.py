"""Reading one MoE layer's expert tensors from safetensors files (the optional `safetensors` package)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from os import PathLike
from typing import Any

from hal import InvalidInput, invalid
from moe.checkpoint.loader import ExpertCheckpointLoader
from moe.checkpoint.names import TensorKind, parse_expert_name, unknown_expert_tensor


def load_safetensors(
    paths: str | PathLike[str] | Iterable[str | PathLike[str]], prefix: str | None, loader: ExpertCheckpointLoader
) -> list[str]:
    """Feed `loader` the expert tensors under `prefix` found in `paths`; the names fed, in order.

    Only what the loader wants is read: this rank's experts (of a fused all-experts tensor,
    only the rows of the local experts) and every expert's `input_scale`; a tensor of an expert that
    no format understands (an int8 zero point) is refused by name, never skipped. Tensors stay on the
    CPU; `loader.build(device=...)` moves the result. `paths` are files (not a directory), at least one,
    every one readable as safetensors before any tensor is fed. Needs the `safetensors` package
    (`pip install moe-hal[checkpoint]`).
    """
    if not isinstance(loader, ExpertCheckpointLoader):
        raise invalid("loader", "a moe.ExpertCheckpointLoader", type(loader).__name__)
    if prefix is not None and not isinstance(prefix, str):
        raise invalid("prefix", "a module path such as 'model.layers.3.mlp' or None", prefix)
    files = _files(paths)
    try:
        safetensors = importlib.import_module("safetensors")
    except ImportError as exc:
        raise InvalidInput(
            "load_safetensors: expected the safetensors package (pip install 'moe-hal[checkpoint]'), got an ImportError"
        ) from exc
    for path in files:  # every file's header first: an unreadable file refuses the load before any tensor is fed
        with _opened(safetensors, path):
            pass
    fed: list[str] = []
    for path in files:
        with _opened(safetensors, path) as f:
            for name in f.keys():
                parsed = parse_expert_name(name, prefix)
                ours = parsed is not None or unknown_expert_tensor(name, prefix) is not None
                if not ours or not loader.wants(name):
                    continue
                local = loader.local_experts
                if (
                    parsed is not None
                    and parsed.fused
                    and parsed.kind is not TensorKind.INPUT_SCALE
                    and len(local) < loader.num_experts
                ):
                    kept = _add_local_rows(loader, name, f.get_slice(name))
                else:
                    kept = loader.add(name, f.get_tensor(name))
                if kept:
                    fed.append(name)
    return fed


def _add_local_rows(loader: ExpertCheckpointLoader, name: str, sliced: Any) -> bool:
    """Feed the local experts' rows of a fused tensor, read without the other ranks' rows. The file's
    own shape is checked first: a tensor of another expert count is refused, never cut to fit."""
    shape = list(sliced.get_shape())
    local = loader.local_experts
    if not shape or shape[0] not in (loader.num_experts, len(local)):
        raise InvalidInput(
            f"{name}: expected a leading dimension of num_experts={loader.num_experts} (or this rank's "
            f"{len(local)} experts), got shape {shape} in the file"
        )
    if shape[0] == len(local):  # the file holds this rank's experts only
        return loader.add(name, sliced[:])
    try:
        return loader.add(name, sliced[local.start : local.stop])
    except InvalidInput as exc:
        raise InvalidInput(f"{exc} (rows {local.start}:{local.stop} of shape {shape} in the file)") from exc


def _files(paths: object) -> list[str]:
    """`paths` (one path or an iterable of them) as a list of existing files, or `InvalidInput` naming `paths`."""
    expected = "a path or an iterable of paths of safetensors files"
    if isinstance(paths, (str, PathLike)):
        given = [paths]
    elif isinstance(paths, Iterable) and not isinstance(paths, (bytes, Mapping)):
        given = list(paths)
    else:
        raise invalid("paths", expected, type(paths).__name__)
    files = []
    for path in given:
        if not isinstance(path, (str, PathLike)):
            raise invalid("paths", expected, f"an entry {path!r}")
        if os.path.isdir(path):
            raise invalid(
                "paths",
                "safetensors files, not a directory (pass its files: sorted(Path(d).glob('*.safetensors')))",
                os.fspath(path),
            )
        if not os.path.isfile(path):
            raise invalid("paths", "existing safetensors files", os.fspath(path))
        files.append(os.fspath(path))
    if not files:
        raise invalid("paths", "at least one safetensors file", "none (an empty iterable)")
    return files


def _opened(safetensors: Any, path: str) -> Any:
    """The open file, or `InvalidInput` naming `paths` for one safetensors cannot read."""
    try:
        return safetensors.safe_open(path, framework="pt")
    except Exception as exc:  # safetensors raises its own error type for a file that is not one of its files
        raise invalid("paths", "readable safetensors files", f"{path} ({type(exc).__name__}: {exc})") from exc
