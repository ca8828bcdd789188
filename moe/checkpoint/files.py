"""Reading one MoE layer's expert tensors from safetensors files (the optional `safetensors` package)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from os import PathLike
from typing import Any

from hal import InvalidInput, invalid
from moe.checkpoint.loader import ExpertCheckpointLoader
from moe.checkpoint.names import TensorKind, malformed_expert_id, parse_expert_name, unknown_expert_tensor
from moe.checkpoint.sources import checkpoint_files


def load_safetensors(
    paths: str | PathLike[str] | Iterable[str | PathLike[str]], prefix: str | None, loader: ExpertCheckpointLoader
) -> list[str]:
    """Feed `loader` the expert tensors under `prefix` found in `paths`; the names fed, in order.

    Only what the loader wants is read: this rank's experts (of a fused all-experts tensor,
    only the rows of the local experts) and every expert's `input_scale`; a tensor of an expert that
    no format understands (an int8 zero point), or of an expert id >= num_experts or no whole number, is
    refused by name, never skipped. Tensors stay on the CPU; `loader.build(device=...)` moves the result.
    `paths` are safetensors files, checkpoint directories or index JSONs (`model.safetensors.index.json`: only
    the shards holding this layer's wanted tensors are opened); every file once, every one readable as
    safetensors and no expert tensor in two of them before any tensor is fed; an error names the file. Needs
    the `safetensors` package (`pip install moe-hal[checkpoint]`).
    """
    if not isinstance(loader, ExpertCheckpointLoader):
        raise invalid("loader", "a moe.ExpertCheckpointLoader", type(loader).__name__)
    if prefix is not None and not isinstance(prefix, str):
        raise invalid("prefix", "a module path such as 'model.layers.3.mlp' or None", prefix)
    files = checkpoint_files(paths, lambda name: _ours(name, prefix) and loader.wants(name))
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


def _opened(safetensors: Any, path: str) -> Any:
    """The open file, or `InvalidInput` naming `paths` for one safetensors cannot read."""
    try:
        return safetensors.safe_open(path, framework="pt")
    except Exception as exc:  # safetensors raises its own error type for a file that is not one of its files
        raise invalid("paths", "readable safetensors files", f"{path} ({type(exc).__name__}: {exc})") from exc
