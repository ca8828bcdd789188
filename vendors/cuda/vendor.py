"""The CUDA vendor: available when torch sees a CUDA device."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from hal import Capabilities, InvalidInput, ProbeResult, ReferenceOps, Vendor, VendorOps
from vendors.cuda.capabilities import DECLARED_MODELS, cuda_capabilities
from vendors.cuda.deep_gemm_runner import find_deep_gemm
from vendors.cuda.deepep import DeepEpProbe, probe_deep_ep
from vendors.cuda.quack_runner import Quack, find_quack
from vendors.cuda.torch_grouped import scaled_grouped_mm_available
from vendors.cuda.tuning import FORCEABLE, TuningTable, device_slug


class CudaVendor(Vendor):
    """NVIDIA GPUs through Triton kernels and torch's grouped GEMMs; one instance drives one
    device (default: the current one). Without Triton every op is the torch reference.

    `tuning` picks the grouped GEMM's kernel configurations: True (default) the table this
    package ships for the device, if any (`vendors/cuda/tuning_tables/`); a path or a
    `TuningTable` that table (what `hal tune` wrote); False the built-in defaults.

    `dependent_launch`: launch the Triton kernels with programmatic dependent launch where the
    device (sm90+) and Triton (`MIN_TRITON_DEPENDENT_LAUNCH`) have it, so each kernel's launch
    overlaps the tail of the one before (bit-equal results); False: plain launches.

    `deep_gemm`: run fp8 block-128 prefill GEMMs on DeepGEMM where it is installed and the device is
    sm90 (`vendors.cuda.deep_gemm_runner`; the capabilities' notes say whether it was found, or why
    not); False: never.

    `quack`: run bf16 grouped GEMMs on quack-kernels' CuTe DSL GEMM where a tuned table names it, quack-kernels
    is installed and the device is sm90 (`vendors.cuda.quack_runner`; the notes say whether it was found);
    False: never (such entries run their fallbacks).

    `force_runner`: `"quack"` or `"deep-gemm"` runs every call of the kind it serves (bf16, fp8 block-128) on
    that library, before the tuned table and the built-in rules (for tests and measurements; a call it cannot
    take runs the table's choice, logged once per problem). None (default): the table and the rules decide.

    `split_fp4_decode`: the weight-only FP4 GEMMs split K into up to four shares at decode
    (`kernels.grouped_gemm_fp4.decode_split_k`; the default): a CUDA-graph replay at 1 token of
    gpt-oss-20b's experts is about 1.4x faster; an eager call reuses scratch kept per stream, at a few
    microseconds of host time. False: one program per tile.
    """

    name = "cuda"
    priority = 100
    description = "NVIDIA GPUs (capabilities from the compute capability)"

    def __init__(
        self,
        device_index: int | None = None,
        *,
        tuning: bool | str | os.PathLike[str] | TuningTable = True,
        dependent_launch: bool = True,
        deep_gemm: bool = True,
        quack: bool = True,
        force_runner: str | None = None,
        split_fp4_decode: bool = True,
    ) -> None:
        super().__init__()
        if device_index is not None and (
            isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0
        ):
            raise InvalidInput(f"device_index: expected a non-negative int or None, got {device_index!r}")
        if not isinstance(tuning, (bool, str, os.PathLike, TuningTable)):
            raise InvalidInput(f"tuning: expected True, False, a path or a TuningTable, got {type(tuning).__name__}")
        if not isinstance(dependent_launch, bool):
            raise InvalidInput(f"dependent_launch: expected True or False, got {dependent_launch!r}")
        if not isinstance(deep_gemm, bool):
            raise InvalidInput(f"deep_gemm: expected True or False, got {deep_gemm!r}")
        if not isinstance(quack, bool):
            raise InvalidInput(f"quack: expected True or False, got {quack!r}")
        if force_runner is not None and force_runner not in FORCEABLE:
            raise InvalidInput(f"force_runner: expected None or one of {', '.join(FORCEABLE)}, got {force_runner!r}")
        self._force_runner = force_runner
        if not isinstance(split_fp4_decode, bool):
            raise InvalidInput(f"split_fp4_decode: expected True or False, got {split_fp4_decode!r}")
        self._split_fp4_decode = split_fp4_decode
        self._library_requests = {"deep_gemm": deep_gemm, "quack": quack}  #: the optional libraries asked for
        self._libraries: dict[str, tuple[Any, str]] = {}  #: each one's module (or None) and note, once looked up
        self._dependent_launch = dependent_launch
        self._device_index = device_index
        if isinstance(tuning, (str, os.PathLike)):
            tuning = TuningTable.load(Path(tuning))  # a bad file is refused here, naming it
        self._tuning_request = tuning
        self._tuning: TuningTable | None = None
        self._triton: str | None = None  #: Triton's version, as the probe found it
        self._deepep: DeepEpProbe | None = None  #: what the probe found of DeepEP (`deepep_probe`)

    def _probe_once(self) -> ProbeResult:
        if torch.version.cuda is None:
            return ProbeResult.unavailable(f"torch {torch.__version__} is built without CUDA")
        if not torch.cuda.is_available():
            return ProbeResult.unavailable(
                f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
                "(no driver, or CUDA_VISIBLE_DEVICES hides them)"
            )
        count = torch.cuda.device_count()
        index = self._index()
        if index >= count:
            return ProbeResult.unavailable(f"device cuda:{index} asked for, but only {count} visible")
        major, minor = torch.cuda.get_device_capability(index)
        self._triton = _triton_version()
        kernels = f"Triton {self._triton}" if self._triton else "no Triton: torch reference ops"
        return ProbeResult.ok(
            f"{count} device(s); cuda:{index} is {torch.cuda.get_device_name(index)} (sm{major}{minor}); {kernels}"
        )

    def _index(self) -> int:
        return torch.cuda.current_device() if self._device_index is None else self._device_index

    def devices(self) -> list[torch.device]:
        self.require_available()
        return [torch.device("cuda", self._index())]

    def device_memory_bytes(self) -> int | None:
        """The device's total memory (`torch.cuda.mem_get_info`), None where the query fails."""
        try:
            return int(torch.cuda.mem_get_info(self.device)[1])
        except Exception:  # no device, or a failed query: unknown, which refuses nothing
            return None

    def _detect_capabilities(self) -> Capabilities:
        index = self._index()
        name = torch.cuda.get_device_name(index)
        self._tuning = _tuning_table(self._tuning_request, name)
        if self._triton is None:
            note = None
        elif self._tuning is not None:
            note = f"kernel configurations: {self._tuning.describe()}"
        else:
            note = (
                f"kernel configurations: built-in defaults (no tuned table for {name}: `hal tune --vendor cuda "
                f"--output {device_slug(name)}.json` makes one; pass it as CudaVendor(tuning=PATH))"
                if self._tuning_request is not False
                else "kernel configurations: built-in defaults (tuning=False)"
            )
        notes = (note, self._launch_note(), self._find_deep_gemm()[1], self._find_quack()[1]) if note else ()
        return cuda_capabilities(
            name,
            torch.cuda.get_device_capability(index),
            kernels=self._triton is not None,
            extra_notes=notes,
            deepep=self.deepep_probe(),
        )

    def deepep_probe(self) -> DeepEpProbe:
        """Whether DeepEP (`deep_ep`) imports here and what its build has: looked up once, when the
        capabilities (or the declared tables) are first asked for, never at import."""
        if self._deepep is None:
            self._deepep = probe_deep_ep()
        return self._deepep

    def _uses_dependent_launch(self) -> bool:
        return (
            self._dependent_launch
            and self._triton is not None
            and dependent_launch_supported(self._triton, torch.cuda.get_device_capability(self._index()))
        )

    def _launch_note(self) -> str:
        if self._uses_dependent_launch():
            return "kernel launches: programmatic dependent launch (each overlaps the tail of the one before)"
        why = (
            "dependent_launch=False"
            if not self._dependent_launch
            else f"needs sm90+ and Triton {'.'.join(map(str, MIN_TRITON_DEPENDENT_LAUNCH))}+"
        )
        return f"kernel launches: plain ({why})"

    def _make_ops(self) -> VendorOps:
        """The Triton kernels where the probe found Triton (torch._grouped_mm from sm90, torch._scaled_grouped_mm
        on sm90), else the reference."""
        if self._triton is None:
            return ReferenceOps()
        from vendors.cuda.ops import CudaOps

        capability = torch.cuda.get_device_capability(self.device)
        ops = CudaOps(
            torch_grouped_mm=capability[0] >= 9 and hasattr(torch, "_grouped_mm"),
            torch_scaled_grouped_mm=scaled_grouped_mm_available(capability),
            deep_gemm=self._find_deep_gemm()[0],
            quack=self._find_quack()[0],
            force_runner=self._force_runner,
            tuning=self._tuning,
            dependent_launch=self._uses_dependent_launch(),
        )
        ops.split_fp4_decode = self._split_fp4_decode
        return ops

    def _find_deep_gemm(self) -> tuple[ModuleType | None, str]:
        """DeepGEMM's module where it serves this device and `deep_gemm` asks for it, and the note saying so."""
        return self._library("deep_gemm", "DeepGEMM", find_deep_gemm)

    def _find_quack(self) -> tuple[Quack | None, str]:
        """quack-kernels where it serves this device and `quack` asks for it, and the note saying so."""
        return self._library("quack", "quack", find_quack)

    def _library(self, option: str, name: str, find: Callable[[tuple[int, int]], tuple[Any, str]]) -> tuple[Any, str]:
        """An optional library, looked up once with `find` where its `option` asks for it, and its note."""
        if option not in self._libraries:
            self._libraries[option] = (
                find(torch.cuda.get_device_capability(self._index()))
                if self._library_requests[option]
                else (None, f"{name}: not used ({option}=False)")
            )
        return self._libraries[option]

    def declared_models(self) -> Mapping[str, Capabilities]:
        probe = self.deepep_probe()
        return {model: cuda_capabilities(name, cc, deepep=probe) for model, (name, cc) in DECLARED_MODELS.items()}


def _tuning_table(request: bool | str | os.PathLike[str] | TuningTable, device_name: str) -> TuningTable | None:
    """The table a `tuning` argument names for this device (None: the built-in defaults)."""
    if request is False:
        return None
    if request is True:
        return TuningTable.packaged(device_name)
    return request if isinstance(request, TuningTable) else TuningTable.load(Path(request))


#: Oldest Triton with `launch_pdl` and `tl.extra.cuda.gdc_wait` / `gdc_launch_dependents`.
MIN_TRITON_DEPENDENT_LAUNCH = (3, 4)


def dependent_launch_supported(triton_version: str, compute_capability: tuple[int, int]) -> bool:
    """Whether programmatic dependent launch is available: sm90 or newer, Triton `MIN_TRITON_DEPENDENT_LAUNCH`+."""
    try:
        version = tuple(int(part) for part in triton_version.split(".")[:2])
    except ValueError:  # an unparsable version (a local build): plain launches
        return False
    return tuple(compute_capability) >= (9, 0) and version >= MIN_TRITON_DEPENDENT_LAUNCH


def _triton_version() -> str | None:
    """Triton's version when it imports, else None (the ops then take the reference path)."""
    try:
        import triton
    except Exception:  # any failure to import means "no kernels here"
        return None
    return str(triton.__version__)
