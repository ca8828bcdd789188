"""The CUDA vendor: available when torch sees a CUDA device."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hal import Capabilities, InvalidInput, ProbeResult, Vendor
from vendors.cpu.ops import TorchReferenceOps
from vendors.cuda.capabilities import DECLARED_MODELS, cuda_capabilities


class CudaVendor(TorchReferenceOps, Vendor):
    """NVIDIA GPUs through torch; one instance drives one device (default: the current one)."""

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
        return ProbeResult.ok(f"{count} device(s); cuda:{index} is "
                              f"{torch.cuda.get_device_name(index)} (sm{major}{minor})")

    def _index(self) -> int:
        return torch.cuda.current_device() if self._device_index is None else self._device_index

    def devices(self) -> list[torch.device]:
        self.require_available()
        return [torch.device("cuda", self._index())]

    def _detect_capabilities(self) -> Capabilities:
        index = self._index()
        return cuda_capabilities(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))

    def declared_models(self) -> Mapping[str, Capabilities]:
        return {model: cuda_capabilities(name, cc) for model, (name, cc) in DECLARED_MODELS.items()}
