"""`NpuBinding`: everything the Ascend vendor takes from its runtime, handed in as one object.

The vendor's code path never asks whether it runs on a real NPU: it calls `binding.ops`
(the `torch_npu` module, or an object with the same op names and signatures) and, for
the fused path, `binding.deep_ep` (the Ascend DeepEP port's module). `load_torch_npu`
builds the binding of a real Ascend host; `vendors.ascend.emulation.emulated_binding`
builds one on the torch_npu emulation.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch


class NpuOps(Protocol):
    """The torch_npu ops the vendor calls (the signatures are torch_npu's)."""

    def npu_dynamic_quant(
        self,
        x: torch.Tensor,
        *,
        smooth_scales: torch.Tensor | None = None,
        group_index: torch.Tensor | None = None,
        dst_type: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def npu_grouped_matmul(
        self, x: list[torch.Tensor], weight: list[torch.Tensor], **kwargs: Any
    ) -> list[torch.Tensor]: ...

    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...

    def npu_moe_init_routing_v2(
        self, x: torch.Tensor, expert_idx: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def npu_moe_finalize_routing(
        self, expanded_permuted_rows: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor: ...


class BindingUnavailable(Exception):
    """The runtime cannot be bound here; the message says why, in words a person can act on."""


@dataclass(frozen=True)
class NpuBinding:
    """The runtime one Ascend vendor instance drives.

    `ops` provides the torch_npu ops; `device` is where tensors live; `soc_name` is what the
    device reports (e.g. `Ascend910B3`), from which the capability table is chosen;
    `deep_ep` is the Ascend DeepEP port's module (with its `Buffer`), or None when it is not
    installed; `label` says what the binding is in reports (e.g. "torch_npu 2.6.0" or
    "torch_npu emulation on the CPU").
    """

    ops: NpuOps
    device: torch.device
    soc_name: str
    device_count: int
    deep_ep: Any | None
    label: str
    #: the HCCL communicator name of a process group (the MC2 ops' `group_ep`), or None without MC2
    comm_name: Callable[[Any], str] | None = None

    def summary(self) -> str:
        """One line for `hal vendors`: devices, SoC, runtime and whether DeepEP is present."""
        deep_ep = "Ascend DeepEP port available" if self.deep_ep is not None else "Ascend DeepEP port not installed"
        return f"{self.device_count} device(s); {self.device} is {self.soc_name}; {self.label}; {deep_ep}"


def load_torch_npu() -> NpuBinding:
    """Bind the real torch_npu of this host, or raise `BindingUnavailable` saying why not."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ModuleNotFoundError as exc:
        if exc.name == "torch_npu":
            raise BindingUnavailable(
                "torch_npu is not installed (on an Ascend host: pip install 'moe-hal[ascend]' with the "
                "CANN toolkit installed and sourced; off Ascend hardware use the vendor 'ascend-emulated')"
            ) from None
        raise BindingUnavailable(f"importing torch_npu failed: {exc}") from None
    except Exception as exc:  # typically ImportError/OSError for CANN libraries that are missing
        raise BindingUnavailable(
            f"importing torch_npu failed: {type(exc).__name__}: {exc} (are the CANN toolkit's libraries "
            "installed and its set_env.sh sourced? see the README's troubleshooting section)"
        ) from None
    npu = torch_npu.npu
    if not npu.is_available() or npu.device_count() == 0:
        raise BindingUnavailable("torch_npu imported, but it sees no NPU device")
    index = npu.current_device()
    return NpuBinding(
        ops=torch_npu,
        device=torch.device("npu", index),
        soc_name=str(npu.get_device_name(index)),
        device_count=int(npu.device_count()),
        deep_ep=_optional_module("deep_ep"),
        label=f"torch_npu {getattr(torch_npu, '__version__', '(version unknown)')}",
        comm_name=_hccl_comm_name,
    )


def _hccl_comm_name(group: Any) -> str:
    """The HCCL communicator name of a process group, as torch_npu's MC2 ops take it (`group_ep`).

    Not run here (no NPU): torch_npu's HCCL backend exposes the name through
    `get_hccl_comm_name(rank)`, as Ascend engines call it."""
    import torch.distributed as dist

    backend = group._get_backend(torch.device("npu"))
    return str(backend.get_hccl_comm_name(dist.get_rank(group)))


def _optional_module(name: str) -> ModuleType | None:
    """The module if it imports, else None (a missing optional library is not an error)."""
    try:
        return importlib.import_module(name)
    except Exception:  # any failure means "not usable here"; the vendor then declares no fused op
        return None
