"""quack-kernels' CuTe DSL grouped GEMM for bf16 experts on Hopper (optional; found at run time).

quack-kernels (`pip install 'moe-hal[quack]'`, docs/quack.md) JIT-compiles CUTLASS CuTe DSL GEMMs. Its
variable-length GEMM takes each group's first row (`cu_seqlens_m`, int32) and, for a first projection, the
dispatch's row index (`A_idx`): it reads the token rows through the index, so no gathered copy is made. The
CUDA vendor runs it where a tuned table names it (backend `quack`): it wins at prefill on some shapes and loses
at others (docs/performance.md), so no built-in rule takes it. A gated call applies SiLU-GLU in the vendor's
swiglu pass after it (quack's gated epilogue wants gate and up columns interleaved, which the layer's weights
are not). The module is imported at the first call that runs on it (the import takes seconds; the first GEMM per
process JIT-compiles, a few seconds more, kept in quack's disk cache): `find_quack` only looks it up.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable

import torch

from hal import GemmKind, PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from vendors.cuda.launch_plans import refuse_recording
from vendors.cuda.torch_grouped import log_unserved_choice
from vendors.cuda.tuning import QUACK, Choice

_LOG = logging.getLogger(__name__)
#: The device generation whose quack GEMMs were checked here (sm90: wgmma); others are not declared.
QUACK_CAPABILITY = (9, 0)
#: The distribution and the package it installs.
DISTRIBUTION, PACKAGE = "quack-kernels", "quack"
#: Its operands' rows and columns must start on 16-byte boundaries: K and N multiples of 8 bf16 values.
ALIGN_ELEMENTS = 8
_INSTALL = "pip install 'moe-hal[quack]' (docs/quack.md)"

GemmFn = Callable[..., torch.Tensor]


class Quack:
    """quack-kernels where it was found: its version, its `gemm` once imported (`gemm()`), and the problems
    whose call raised in it (`failed`: those run their fallbacks from then on)."""

    def __init__(self, version: str) -> None:
        self.version = version
        self._gemm: GemmFn | None = None
        self.failure: str | None = None  #: why its import failed, once it has
        self.failed: dict[tuple[object, ...], str] = {}  #: problem -> the error its call raised

    def gemm(self) -> GemmFn | None:
        """`quack.gemm_interface.gemm`, imported at the first ask; None (logged once) where the import fails."""
        if self._gemm is None and self.failure is None:
            _LOG.info("quack-kernels %s: importing its GEMM (first call; its first GEMM JIT-compiles)", self.version)
            try:
                self._gemm = importlib.import_module(f"{PACKAGE}.gemm_interface").gemm
            except Exception as exc:  # noqa: BLE001 - a build that does not import is a reason, never fatal
                self.failure = f"{type(exc).__name__}: {exc}"
                _LOG.warning(
                    "quack-kernels %s does not import (%s); its table entries run their fallbacks",
                    self.version,
                    self.failure,
                )
        return self._gemm


def find_quack(capability: tuple[int, int]) -> tuple[Quack | None, str]:
    """quack-kernels where it is installed and serves this device, else None; and a line saying which (or why
    not). Nothing is imported here."""
    sm = f"sm{capability[0]}{capability[1]}"
    if tuple(capability) != QUACK_CAPABILITY:
        return None, f"quack: not used (its grouped GEMMs are checked here on sm90; this device is {sm})"
    if importlib.util.find_spec(PACKAGE) is None:
        return None, f"quack: not installed ({_INSTALL})"
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None, f"quack: a `{PACKAGE}` module is importable but {DISTRIBUTION} is not installed ({_INSTALL})"
    return Quack(version), f"quack-kernels {version}: bf16 grouped GEMMs (CuTe DSL) where the tuned table names them"


def quack_fits(
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
    weight: QuantizedWeight,
    kind: GemmKind,
    out_dtype: torch.dtype,
) -> bool:
    """Whether a call can run as quack's GEMM: bf16 rows `[M, K]` (unit column stride) and bf16 weights
    `[E, K, N]` with unit stride along K or N, K and N multiples of `ALIGN_ELEMENTS`, every row and expert
    starting on a 16-byte boundary, bf16 out."""
    if kind is not GemmKind.BF16 or out_dtype != torch.bfloat16 or type(x) is not torch.Tensor:
        return False
    w = weight.data
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.dim() != 2 or w.dim() != 3:
        return False
    _, k, n = w.shape
    if w.stride(2) == 1:
        w_lead = w.stride(1)
    elif w.stride(1) == 1:
        w_lead = w.stride(2)
    else:
        return False
    return (
        x.shape[1] == k
        and k % ALIGN_ELEMENTS == 0
        and n % ALIGN_ELEMENTS == 0
        and x.stride(-1) == 1
        and x.stride(0) % ALIGN_ELEMENTS == 0
        and w_lead % ALIGN_ELEMENTS == 0
        and w.stride(0) % ALIGN_ELEMENTS == 0
        and x.data_ptr() % 16 == 0
        and w.data_ptr() % 16 == 0
    )


def quack_or_fallback(
    quack: Quack | None,
    choice: Choice | None,
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
    weight: QuantizedWeight,
    kind: GemmKind,
    out_dtype: torch.dtype,
    unserved: set[tuple[object, ...]],
) -> tuple[GemmFn | None, Choice | None]:
    """quack's GEMM where the table's `choice` names it and it can run the call, else None; and the choice the
    other runners follow: a `quack` entry that cannot run gives way to its fallback, logged once per problem
    through `unserved` (at info level where quack is not installed, a warning where it is but cannot serve)."""
    if choice is None or choice.backend != QUACK:
        return None, choice
    if quack is not None and quack_fits(x, weight, kind, out_dtype) and problem_of(x, weight) not in quack.failed:
        gemm = quack.gemm()
        if gemm is not None:
            return gemm, choice
    level = logging.INFO if quack is None else logging.WARNING
    log_unserved_choice(unserved, kind, weight, out_dtype, QUACK, fallback=choice.fallback, level=level)
    return None, choice.fallback


def problem_of(x: torch.Tensor | QuantizedTensor | PackedInt4Tensor, weight: QuantizedWeight) -> tuple[object, ...]:
    """What a failure of quack's GEMM is remembered by: the weights' shape and the rows' dtype."""
    return (tuple(weight.data.shape), x.dtype if isinstance(x, torch.Tensor) else None)


def quack_or_none(
    quack: Quack,
    gemm: GemmFn,
    data: torch.Tensor,
    weight: QuantizedWeight,
    counts: torch.Tensor,
    row_index: torch.Tensor | None,
) -> torch.Tensor | None:
    """`quack_grouped`, or None where quack's GEMM raises (a kernel that does not compile or launch here): the
    problem is then remembered in `quack.failed`, logged once as a warning, and its calls run the fallback."""
    try:
        return quack_grouped(gemm, data, weight.data, counts, row_index)
    except Exception as exc:  # noqa: BLE001 - a library failure becomes the fallback, never the caller's crash
        problem = problem_of(data, weight)
        quack.failed[problem] = f"{type(exc).__name__}: {exc}"
        _LOG.warning(
            "quack-kernels %s failed on experts %s (%s); their calls run the table's fallback from now on",
            quack.version,
            "x".join(map(str, weight.data.shape)),
            quack.failed[problem],
        )
        return None


def quack_grouped(
    gemm: GemmFn, data: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, row_index: torch.Tensor | None
) -> torch.Tensor:
    """`y[rows of g] = data[rows of g] @ w[g]` (rows sorted by group; through `row_index` where given) on quack's
    variable-length GEMM, in bf16. Rows past the groups' total are left unwritten, as the other runners leave
    them. No host synchronisation: the offsets are made on the device."""
    refuse_recording("quack-kernels' own kernels (not recorded in a launch plan)")
    rows = data.shape[0] if row_index is None else row_index.numel()
    e, _, n = w.shape
    if rows == 0:
        return torch.empty(0, n, dtype=torch.bfloat16, device=data.device)
    offsets = torch.zeros(e + 1, dtype=torch.int32, device=data.device)
    torch.cumsum(counts, 0, dtype=torch.int32, out=offsets[1:])
    index = None if row_index is None else row_index.to(torch.int32)
    return gemm(data, w, cu_seqlens_m=offsets, A_idx=index, tuned=False)
