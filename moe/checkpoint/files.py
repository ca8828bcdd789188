"""Reading one MoE layer's expert tensors from safetensors files (the optional `safetensors` package)."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from os import PathLike
from typing import Any

from hal import InvalidInput, invalid
from moe.checkpoint.loader import ExpertCheckpointLoader
from moe.checkpoint.names import TensorKind, malformed_expert_id, parse_expert_name, unknown_expert_tensor


def load_safetensors(
    paths: str | PathLike[str] | Iterable[str | PathLike[str]], prefix: str | None, loader: ExpertCheckpointLoader
) -> list[str]:
    """Feed `loader` the expert tensors under `prefix` found in `paths`; the names fed, in order.

    Only what the loader wants is read: this rank's experts (of a fused all-experts tensor,
    only the rows of the local experts) and every expert's `input_scale`; a tensor of an expert that
    no format understands (an int8 zero point), or of an expert id >= num_experts or no whole number, is
    refused by name, never skipped. Tensors stay on the CPU; `loader.build(device=...)` moves the result.
    `paths` are files (not a directory or an index JSON), at least one, each once, every one readable as
    safetensors and no expert tensor in two of them before any tensor is fed; an error names the file. Needs
    the `safetensors` package (`pip install moe-hal[checkpoint]`).
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
    owners: dict[str, str] = {}
    for path in files:  # every file's header first: an unreadable file refuses the load before any tensor is fed
        with _opened(safetensors, path) as f:
            for name in f.keys():
                if name in owners and _ours(name, prefix) and loader.wants(name):
                    raise InvalidInput(f"{name}: expected in one of the files, got it in {owners[name]} and {path}")
                owners[name] = path
    fed: list[str] = []
    for path in files:
        with _opened(safetensors, path) as f:
            for name in f.keys():
                if not _ours(name, prefix) or not loader.wants(name):
                    continue
                try:
                    kept = _add(loader, name, f)
                except InvalidInput as exc:
                    raise InvalidInput(f"{exc} (file: {path})") from exc
                if kept:
                    fed.append(name)
    return fed


def _ours(name: str, prefix: str | None) -> bool:
    """Whether `name` is a tensor of an expert's projection under `prefix` (understood or to be refused)."""
    return (
        parse_expert_name(name, prefix) is not None
        or unknown_expert_tensor(name, prefix) is not None
        or malformed_expert_id(name, prefix) is not None
    )


def _add(loader: ExpertCheckpointLoader, name: str, f: Any) -> bool:
    """Read `name` from the open file `f` and feed it; of a fused all-experts tensor, only this rank's rows."""
    parsed = parse_expert_name(name)
    if (
        parsed is not None
        and parsed.fused
        and parsed.kind is not TensorKind.INPUT_SCALE
        and len(loader.local_experts) < loader.num_experts
    ):
        return _add_local_rows(loader, name, _read(name, lambda: f.get_slice(name)))
    return loader.add(name, _read(name, lambda: f.get_tensor(name)))


def _read(name: str, read: Callable[[], Any]) -> Any:
    """`read()`, or `InvalidInput` naming the tensor for one torch cannot hold (an fp6 dtype, an odd fp4 shape)."""
    try:
        return read()
    except Exception as exc:  # safetensors' and torch's own errors for a tensor they cannot make
        raise InvalidInput(
            f"{name}: expected a tensor torch can read, got {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        ) from exc


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
        return loader.add(name, _read(name, lambda: sliced[:]))
    rows = _read(name, lambda: sliced[local.start : local.stop])
    try:
        return loader.add(name, rows)
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
        if os.fspath(path).endswith(".json"):
            raise invalid(
                "paths", "safetensors files, not an index (pass the shards its weight_map names)", _index(path)
            )
        if os.path.realpath(path) in (os.path.realpath(p) for p in files):
            raise invalid("paths", "each file once", f"{os.fspath(path)} twice")
        files.append(os.fspath(path))
    if not files:
        raise invalid("paths", "at least one safetensors file", "none (an empty iterable)")
    return files


def _index(path: str | PathLike[str]) -> str:
    """`path`, with the shards its `weight_map` names where it is a readable index."""
    try:
        with open(path, encoding="utf-8") as fh:
            shards = sorted(set(json.load(fh)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{os.fspath(path)} (a JSON file)"
    listed = ", ".join(map(str, shards[:4])) + (", ..." if len(shards) > 4 else "")
    return f"{os.fspath(path)} (an index of {len(shards)} shard(s): {listed})"


def _opened(safetensors: Any, path: str) -> Any:
    """The open file, or `InvalidInput` naming `paths` for one safetensors cannot read."""
    try:
        return safetensors.safe_open(path, framework="pt")
    except Exception as exc:  # safetensors raises its own error type for a file that is not one of its files
        raise invalid("paths", "readable safetensors files", f"{path} ({type(exc).__name__}: {exc})") from exc
