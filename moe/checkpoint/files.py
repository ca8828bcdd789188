"""Reading one MoE layer's expert tensors from safetensors files (the optional `safetensors` package)."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from os import PathLike

from hal import InvalidInput
from moe.checkpoint.loader import ExpertCheckpointLoader
from moe.checkpoint.names import TensorKind, parse_expert_name


def load_safetensors(paths: str | PathLike[str] | Iterable[str | PathLike[str]], prefix: str | None,
                     loader: ExpertCheckpointLoader) -> list[str]:
    """Feed `loader` the expert tensors under `prefix` found in `paths`; the names fed, in order.

    Only what the loader wants is read: this rank's experts (of a fused all-experts tensor,
    only the rows of the local experts) and every expert's `input_scale`. Tensors stay on the
    CPU; `loader.build(device=...)` moves the result. Needs the `safetensors` package
    (`pip install moe-hal[checkpoint]`).
    """
    try:
        safetensors = importlib.import_module("safetensors")
    except ImportError as exc:
        raise InvalidInput("load_safetensors: expected the safetensors package "
                           "(pip install 'moe-hal[checkpoint]'), got an ImportError") from exc
    files = [paths] if isinstance(paths, (str, PathLike)) else list(paths)
    fed: list[str] = []
    for path in files:
        with safetensors.safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                parsed = parse_expert_name(name, prefix)
                if parsed is None or not loader.wants(name):
                    continue
                local = loader.local_experts
                if parsed.fused and parsed.kind is not TensorKind.INPUT_SCALE and len(local) < loader.num_experts:
                    tensor = f.get_slice(name)[local.start:local.stop]  # the local experts' rows only
                else:
                    tensor = f.get_tensor(name)
                if loader.add(name, tensor):
                    fed.append(name)
    return fed
