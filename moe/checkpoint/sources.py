"""Which safetensors files a load reads: files as given, a checkpoint directory, or a sharded checkpoint's index."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from os import PathLike
from pathlib import PurePath
from typing import Any

from hal import invalid

INDEX_SUFFIX = ".safetensors.index.json"
_EXPECTED = "a path or an iterable of paths of safetensors files, checkpoint directories or index JSONs"


def checkpoint_files(paths: object, wanted: Callable[[str], bool]) -> list[str]:
    """`paths` as the list of safetensors files to read, or `InvalidInput` naming `paths`.

    Each entry is a safetensors file, a directory (its `*.safetensors.index.json` where it has one, else
    all its `*.safetensors` files) or an index JSON (`weight_map`: tensor name -> shard file beside it).
    Of an index only the shards holding a tensor `wanted(name)` are kept, so a rank reads only its
    layer's shards and the others need not be present. Every file appears once.
    """
    if isinstance(paths, (str, PathLike)):
        given = [paths]
    elif isinstance(paths, Iterable) and not isinstance(paths, (bytes, Mapping)):
        given = list(paths)
    else:
        raise invalid("paths", _EXPECTED, type(paths).__name__)
    if not given:
        raise invalid("paths", "at least one safetensors file", "none (an empty iterable)")
    files: list[str] = []
    seen: set[str] = set()
    for path in given:
        if not isinstance(path, (str, PathLike)):
            raise invalid("paths", _EXPECTED, f"an entry {path!r}")
        for file in _expand(os.fspath(path), wanted):
            real = os.path.realpath(file)
            if real in seen:
                raise invalid("paths", "each file once", f"{file} twice")
            seen.add(real)
            files.append(file)
    return files


def _expand(path: str, wanted: Callable[[str], bool]) -> list[str]:
    """The safetensors files `path` stands for."""
    if os.path.isdir(path):
        indexes = sorted(n for n in os.listdir(path) if n.endswith(INDEX_SUFFIX))
        if len(indexes) > 1:
            raise invalid("paths", "a checkpoint directory with at most one index JSON", f"{path} ({indexes})")
        if indexes:
            return _shards_of(os.path.join(path, indexes[0]), wanted)
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise invalid("paths", "a directory holding safetensors files or an index JSON", f"{path} (none)")
        return [f for f in files if os.path.isfile(f)]
    if not os.path.isfile(path):
        raise invalid("paths", "existing safetensors files, checkpoint directories or index JSONs", path)
    if path.endswith(".json"):
        return _shards_of(path, wanted)
    return [path]


def _shards_of(index: str, wanted: Callable[[str], bool]) -> list[str]:
    """The shard files beside `index` that hold a wanted tensor, in the order the index first names them."""
    weight_map = _weight_map(index)
    folder = os.path.dirname(index)
    shards: list[str] = []
    for name, shard in weight_map.items():
        if not wanted(name) or shard in shards:
            continue
        shards.append(shard)
    files = []
    for shard in shards:
        file = os.path.join(folder, shard)
        if not os.path.isfile(file):
            holds = next(n for n, s in weight_map.items() if s == shard and wanted(n))
            raise invalid("paths", f"the shards {index} names", f"{file} missing (it holds {holds})")
        files.append(file)
    return files


def _weight_map(index: str) -> dict[str, str]:
    """The index's `weight_map`, checked: tensor names to shard file names in the index's own directory."""
    try:
        with open(index, encoding="utf-8") as fh:
            content: Any = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise invalid("paths", "a readable index JSON", f"{index} ({type(exc).__name__}: {exc})") from exc
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict):
        raise invalid("paths", "an index JSON with a 'weight_map' object", f"{index} (no weight_map)")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _plain_file_name(shard):
            raise invalid("paths", "an index naming shard files beside it", f"{index} maps {name} to {shard!r}")
    return weight_map


def _plain_file_name(name: str) -> bool:
    """Whether `name` is a `.safetensors` file in the index's directory or below it (no absolute path, no `..`)."""
    return (
        name.endswith(".safetensors")
        and not os.path.isabs(name)
        and "\\" not in name
        and ".." not in PurePath(name).parts
    )
