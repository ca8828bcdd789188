"""The Ascend vendor: probe and declared capabilities; torch_npu is imported only when probing."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import NoReturn

import torch

from hal import (
    Capabilities,
    DispatchDtype,
    Groups,
    ProbeResult,
    QuantizedTensor,
    QuantizedWeight,
    ScaleLayout,
    UnsupportedCapability,
    Vendor,
)
from vendors.ascend.capabilities import DECLARED_MODELS, ascend_capabilities, generation_of


class AscendVendor(Vendor):
    """Huawei Ascend NPUs through torch_npu.

    The ops through torch_npu are not part of this release: on an NPU host each op
    raises `UnsupportedCapability` saying so. Probing and the declared tables work
    everywhere.
    """

    name = "ascend"
    priority = 90
    description = "Huawei Ascend NPUs through torch_npu (Atlas A2/A3)"

    def __init__(self) -> None:
        super().__init__()
        self._npu: ModuleType | None = None

    def _probe_once(self) -> ProbeResult:
        try:
            torch_npu = importlib.import_module("torch_npu")
        except ModuleNotFoundError as exc:
            if exc.name == "torch_npu":
                return ProbeResult.unavailable(
                    "torch_npu is not installed (on an Ascend host: pip install 'moe-hal[ascend]' "
                    "with the CANN toolkit installed and sourced)")
            return ProbeResult.unavailable(f"importing torch_npu failed: {exc}")
        except Exception as exc:  # typically OSError/ImportError for missing CANN libraries
            return ProbeResult.unavailable(
                f"importing torch_npu failed: {type(exc).__name__}: {exc} "
                "(are the CANN toolkit's libraries installed and its set_env.sh sourced?)")
        self._npu = torch_npu
        if not torch_npu.npu.is_available() or torch_npu.npu.device_count() == 0:
            return ProbeResult.unavailable("torch_npu imported, but it sees no NPU device")
        return ProbeResult.ok(f"{torch_npu.npu.device_count()} NPU(s); npu:0 is {self._soc_name()}")

    def _soc_name(self) -> str:
        npu = self._npu
        if npu is None:  # only reached after a successful probe
            raise UnsupportedCapability("vendor 'ascend': torch_npu has not been probed")
        return str(npu.npu.get_device_name(npu.npu.current_device()))

    def devices(self) -> list[torch.device]:
        self.require_available()
        npu = self._npu
        return [torch.device("npu", npu.npu.current_device())]  # type: ignore[union-attr]

    def _detect_capabilities(self) -> Capabilities:
        soc = self._soc_name()
        generation = generation_of(soc)
        if generation is None:
            return ascend_capabilities(soc, "A2", (f"unrecognised SoC {soc!r}: using the A2 table",))
        return ascend_capabilities(soc, generation)

    def declared_models(self) -> Mapping[str, Capabilities]:
        return DECLARED_MODELS

    def _not_in_this_release(self, op: str) -> NoReturn:
        raise UnsupportedCapability(
            f"vendor 'ascend': {op} through torch_npu is not part of this release; "
            "use the cpu vendor, or plan with `hal explain --vendor ascend`")

    def quantize(self, x: torch.Tensor, dtype: DispatchDtype, *, layout: ScaleLayout | None = None,
                 global_scale: torch.Tensor | None = None) -> QuantizedTensor:
        self._not_in_this_release("quantize")

    def dequantize(self, q: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self._not_in_this_release("dequantize")

    def quantize_weight(self, weight: torch.Tensor, layout: ScaleLayout,
                        dtype: torch.dtype | None = None) -> QuantizedWeight:
        self._not_in_this_release("quantize_weight")

    def grouped_matmul(self, x: torch.Tensor | QuantizedTensor, weight: QuantizedWeight, groups: Groups,
                       *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        self._not_in_this_release("grouped_matmul")

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        self._not_in_this_release("swiglu")
