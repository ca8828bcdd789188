"""All or nothing: what a layer holds before a load, put back when the load is refused.

A weight store replaces its buffers when it loads (the old tensors are only dropped), so
remembering which tensors it held costs nothing; the other buffers (a shared-expert gate,
load counters) are copied into in place by `load_state_dict`, so their values are kept too
(they are small). `restore` gives every module its tensors and its stored weights' view back.
"""

from __future__ import annotations

from typing import Any

import torch

from moe.weight_store import WeightStore

#: A weight store's attributes that describe what it holds.
_STORE_STATE = ("_weights", "_layouts", "_activation")


class Snapshot:
    """The tensors and stored weights of `module` and its submodules at the time it is taken."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._modules: list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any], dict[str, Any]]] = []
        self._values: list[tuple[torch.Tensor, torch.Tensor]] = []
        for m in module.modules():
            stored = {name: getattr(m, name) for name in _STORE_STATE} if isinstance(m, WeightStore) else {}
            self._modules.append((m, dict(m._buffers), dict(m._parameters), stored))
            if not isinstance(m, WeightStore):  # copied into in place by load_state_dict
                for t in (*m._buffers.values(), *m._parameters.values()):
                    if t is not None:
                        self._values.append((t, t.detach().clone()))

    def restore(self) -> None:
        """Put every tensor and stored view back as it was."""
        with torch.no_grad():
            for t, value in self._values:
                if t.shape == value.shape and t.dtype == value.dtype:
                    t.copy_(value)
        for m, buffers, parameters, stored in self._modules:
            m._buffers.clear()
            m._buffers.update(buffers)
            m._parameters.clear()
            m._parameters.update(parameters)
            for name, value in stored.items():
                setattr(m, name, value)
