"""The CUDA vendor: available when torch sees a CUDA device."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hal import Capabilities, InvalidInput, ProbeResult, ReferenceOps, Vendor, VendorOps
from vendors.cuda.capabilities import DECLARED_MODELS, cuda_capabilities


class CudaVendor(Vendor):
    """NVIDIA GPUs through Triton kernels and torch's grouped GEMMs; one instance drives one
    device (default: the current one). Without Triton every op is the torch reference."""

    name = "cuda"
    priority = 100
    description = "NVIDIA GPUs (capabilities from the compute capability)"

    def __init__(self, device_index: int | None = None) -> None:
        super().__init__()
        if device_index is not None and (isinstance(device_index, bool) or not isinstance(device_index, int)
                                         or device_index < 0):
            raise InvalidInput(f"device_index: expected a non-negative int or None, got {device_index!r}")
        self._device_index = device_index
        self._triton: str | None = None  #: Triton's version, as the probe found it

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
        self._triton = _triton_version()
        kernels = f"Triton {self._triton}" if self._triton else "no Triton: torch reference ops"
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
                                 kernels=self._triton is not None)

    def _make_ops(self) -> VendorOps:
        """The Triton kernels where the probe found Triton (torch._grouped_mm from sm90), else the reference."""
        if self._triton is None:
            return ReferenceOps()
        from vendors.cuda.ops import CudaOps

        major, _ = torch.cuda.get_device_capability(self.device)
        return CudaOps(torch_grouped_mm=major >= 9 and hasattr(torch, "_grouped_mm"))

    def declared_models(self) -> Mapping[str, Capabilities]:
        return {model: cuda_capabilities(name, cc) for model, (name, cc) in DECLARED_MODELS.items()}


def _triton_version() -> str | None:
    """Triton's version when it imports, else None (the ops then take the reference path)."""
    try:
        import triton
    except Exception:  # any failure to import means "no kernels here"
        return None
    return str(triton.__version__)
