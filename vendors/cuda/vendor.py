"""The CUDA vendor: available when torch sees a CUDA device."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hal import Capabilities, InvalidInput, ProbeResult, Vendor
from vendors.cuda.capabilities import DECLARED_MODELS, cuda_capabilities
from vendors.cuda.ops import CudaOps


class CudaVendor(CudaOps, Vendor):
    """NVIDIA GPUs through Triton kernels and torch's grouped GEMMs; one instance drives one
    device (default: the current one). Without Triton the ops take the torch reference path."""

    name = "cuda"
    priority = 100
    description = "NVIDIA GPUs (capabilities from the compute capability)"

    def __init__(self, device_index: int | None = None) -> None:
        super().__init__()
        if device_index is not None and (isinstance(device_index, bool) or not isinstance(device_index, int)
                                         or device_index < 0):
            raise InvalidInput(f"device_index: expected a non-negative int or None, got {device_index!r}")
        self._device_index = device_index

    def _probe_once(self) -> ProbeResult:
        if torch.version.cuda is None:
            return ProbeResult.unavailable(f"torch {torch.__version__} is built without CUDA")
        if not torch.cuda.is_available():
            return ProbeResult.unavailable(
                f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
                "(no driver, or CUDA_VISIBLE_DEVICES hides them)")
        count = torch.cuda.device_count()
        index = self._index()
        if index >= count:
            return ProbeResult.unavailable(f"device cuda:{index} asked for, but only {count} visible")
        major, minor = torch.cuda.get_device_capability(index)
        self.kernels_available = _triton_version() is not None
        self.use_torch_grouped_mm = major >= 9 and hasattr(torch, "_grouped_mm")
        kernels = f"Triton {_triton_version()}" if self.kernels_available else "no Triton: torch reference ops"
        return ProbeResult.ok(f"{count} device(s); cuda:{index} is "
                              f"{torch.cuda.get_device_name(index)} (sm{major}{minor}); {kernels}")

    def _index(self) -> int:
        return torch.cuda.current_device() if self._device_index is None else self._device_index

    def devices(self) -> list[torch.device]:
        self.require_available()
        return [torch.device("cuda", self._index())]

    def _detect_capabilities(self) -> Capabilities:
        index = self._index()
        return cuda_capabilities(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index),
                                 kernels=self.kernels_available)

    def declared_models(self) -> Mapping[str, Capabilities]:
        return {model: cuda_capabilities(name, cc) for model, (name, cc) in DECLARED_MODELS.items()}


def _triton_version() -> str | None:
    """Triton's version when it imports, else None (the ops then take the reference path)."""
    try:
        import triton
    except Exception:  # any failure to import means "no kernels here"
        return None
    return str(triton.__version__)
