"""DeepGEMM's m-grouped fp8 GEMM for the fp8 block-128 kind on Hopper (optional; found at run time).

DeepGEMM (github.com/deepseek-ai/DeepGEMM, built from its repository: the registry's `deep-gemm` is an old
source distribution that does not build) JIT-compiles CUTLASS/CuTe grouped GEMMs with 1x128 activation and
128x128 weight scales, the `fp8-block128` contract. Its contiguous layout wants each group's rows to start at a
multiple of 128; the rows here come sorted by group without gaps, so one gather places them (through the
dispatch's index, for a first projection) into an aligned buffer, the GEMM runs on that with the groups' end
rows (its "psum" layout, which skips the gaps), and a second gather brings the product back to the sorted rows
(for a gated call, the activation pass reads the product through the same index instead). The gathers move
whole rows as 8-byte words; no host synchronisation.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

import torch

from hal import GemmKind, InvalidInput, PackedInt4Tensor, QuantizedTensor, QuantizedWeight
from vendors.cuda.launch_plans import refuse_recording
from vendors.cuda.torch_grouped import log_unserved_choice
from vendors.cuda.tuning import DEEP_GEMM, Choice

#: DeepGEMM's sm90 kernels (the sm100 ones take packed ue8m0 scales, a different contract).
DEEP_GEMM_CAPABILITY = (9, 0)
#: Its contiguous layout aligns each group's first row to this many rows (its default; a process may change it
#: through `deep_gemm.set_mk_alignment_for_contiguous_layout`, so each call asks the module).
ALIGN_ROWS = 128
#: The built-in rule (where the table has no entry) takes DeepGEMM from this many rows per group and experts of
#: at least `DEEP_GEMM_MIN_WEIGHT_ELEMENTS` (K x N). On an H200 (graph replay, whole layers) it made the
#: fp8 block-128 layer 1.25-1.35x faster than the Triton kernel on deepseek-v3-ep8 (K x N 14.7M and 29.4M) at
#: 4096 and 16384 tokens and 1.76x on mixtral-8x7b at 16384; on qwen3-30b-a3b's small experts (1.6M, 3.1M) at
#: 16384 tokens 0.95x: the two gathers around the GEMM cost more than the GEMM saves there.
DEEP_GEMM_MIN_ROWS_PER_GROUP = 256
DEEP_GEMM_MIN_WEIGHT_ELEMENTS = 1 << 23


def find_deep_gemm(capability: tuple[int, int]) -> tuple[ModuleType | None, str]:
    """DeepGEMM's module where it serves this device, else None; and a line saying which (or why not). The
    first import runs in a child process first: a build that crashes on import (a C++ runtime other than
    the one it was built against) is then a reason, not a crash of the caller."""
    sm = f"sm{capability[0]}{capability[1]}"
    if tuple(capability) != DEEP_GEMM_CAPABILITY:
        return None, f"DeepGEMM: not used (its fp8 block-128 kernels here are sm90's; this device is {sm})"
    if importlib.util.find_spec("deep_gemm") is None:
        return None, f"DeepGEMM: not installed ({_INSTALL})"
    try:
        child = subprocess.run(
            [sys.executable, "-c", "import deep_gemm"], capture_output=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"DeepGEMM: its import could not be checked ({type(exc).__name__}: {exc})"
    if child.returncode != 0:
        last = (child.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        return None, f"DeepGEMM: installed but its import fails (exit {child.returncode}: {last}; {_INSTALL})"
    try:
        module = importlib.import_module("deep_gemm")
    except Exception as exc:  # noqa: BLE001 - a build that does not load here is reported, never fatal
        return None, f"DeepGEMM: installed but does not import ({type(exc).__name__}: {exc})"
    version = getattr(module, "__version__", "?")
    missing = missing_api(module)
    if missing:
        return None, f"DeepGEMM {version}: {missing} (build a newer one: {_INSTALL})"
    rule = f"from {DEEP_GEMM_MIN_ROWS_PER_GROUP} rows per expert on experts of K x N >= {DEEP_GEMM_MIN_WEIGHT_ELEMENTS}"
    return module, f"DeepGEMM {version}: fp8 block-128 grouped GEMMs {rule}"


_INSTALL = "build it from github.com/deepseek-ai/DeepGEMM as docs/deep-gemm.md says"


def missing_api(module: object) -> str | None:
    """What a `deep_gemm` module lacks of the API this runner calls (None: nothing): the m-grouped fp8 GEMM with
    its psum layout (older builds take only a per-row group index)."""
    gemm = getattr(module, "m_grouped_fp8_gemm_nt_contiguous", None)
    if not callable(gemm):
        return "no m_grouped_fp8_gemm_nt_contiguous"
    if "use_psum_layout" not in (getattr(gemm, "__doc__", None) or ""):
        return "its m_grouped_fp8_gemm_nt_contiguous takes no use_psum_layout"
    return None


def wants_deep_gemm(choice: Choice | None, kind: GemmKind, rows: int, groups: int, k: int, n: int) -> bool:
    """Whether a call of `kind` asks for DeepGEMM: as the table's `choice` says where it has one (even for a kind
    DeepGEMM cannot run: the caller then logs it), else from `DEEP_GEMM_MIN_ROWS_PER_GROUP` rows per group on
    experts of `DEEP_GEMM_MIN_WEIGHT_ELEMENTS` (fp8 block-128 only)."""
    if rows == 0:
        return False
    if choice is not None:
        return choice.backend == DEEP_GEMM
    return (
        kind is GemmKind.FP8_BLOCK128
        and rows >= DEEP_GEMM_MIN_ROWS_PER_GROUP * groups
        and k * n >= DEEP_GEMM_MIN_WEIGHT_ELEMENTS
    )


def deep_gemm_or_fallback(
    module: ModuleType | None,
    choice: Choice | None,
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
    weight: QuantizedWeight,
    kind: GemmKind,
    out_dtype: torch.dtype,
    rows: int,
    groups: int,
    unserved: set[tuple[object, ...]],
) -> tuple[bool, Choice | None]:
    """Whether the call runs on DeepGEMM: found (`module`), asked for (`wants_deep_gemm`) and able to take the
    operands (`deep_gemm_fits`); and the choice the other runners follow: a
    `deep-gemm` entry that cannot run here gives way to its fallback (the entry it replaced; None: the built-in
    rules), logged once per problem through `unserved` (at info level where DeepGEMM is not installed: shipped
    tables name it for users without it; a warning where it is, but does not take the call's operands)."""
    if (
        module is not None
        and wants_deep_gemm(choice, kind, rows, groups, *weight.data.shape[1:])
        and deep_gemm_fits(x, weight, kind, out_dtype)
    ):
        return True, choice
    if choice is not None and choice.backend == DEEP_GEMM:
        level = logging.INFO if module is None else logging.WARNING
        log_unserved_choice(unserved, kind, weight, out_dtype, DEEP_GEMM, fallback=choice.fallback, level=level)
        return False, choice.fallback
    return False, choice


def deep_gemm_fits(
    x: torch.Tensor | QuantizedTensor | PackedInt4Tensor,
    weight: QuantizedWeight,
    kind: GemmKind,
    out_dtype: torch.dtype,
) -> bool:
    """Whether a call can run as DeepGEMM's fp8 GEMM: fp8 block-128, fp8 rows with `[rows, K/128]` fp32 scales,
    K-major fp8 weights `[E, K, N]` with `[E, K/128, N/128]` fp32 scales, K and N multiples of 128, bf16 out."""
    if kind is not GemmKind.FP8_BLOCK128 or out_dtype != torch.bfloat16 or not isinstance(x, QuantizedTensor):
        return False
    w, ws, xs = weight.data, weight.scale, x.scale
    if w.dim() != 3 or ws is None or xs is None:
        return False
    e, k, n = w.shape
    return (
        k % ALIGN_ROWS == 0
        and n % ALIGN_ROWS == 0
        and x.data.dtype == torch.float8_e4m3fn
        and x.data.dim() == 2
        and x.data.stride(-1) == 1
        and xs.dtype == torch.float32
        and tuple(xs.shape) == (x.data.shape[0], k // ALIGN_ROWS)
        and w.dtype == torch.float8_e4m3fn
        and w.stride(1) == 1
        and ws.dtype == torch.float32
        and tuple(ws.shape) == (e, k // ALIGN_ROWS, n // ALIGN_ROWS)
    )


def aligned_layout(
    counts: torch.Tensor, rows: int, row_index: torch.Tensor | None = None, align: int = ALIGN_ROWS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `rows` rows in groups of `counts` (sorted by group): `source`, the row of x each aligned row reads
    (x's rows through `row_index` where given, else x's own rows; gap rows read row 0, their products unused);
    `place`, each sorted row's row in the aligned buffer; `ends`, each group's end row there (int32). Rows past
    the groups' total (a masked layout's padding: counts may sum to fewer than `rows`) are placed after the last
    group, outside every group, so they never land on a group's row; their products are left unwritten. The
    buffer's length, `len(source)`, is a bound fixed by the shape (rows + groups x (align - 1), rounded up to
    `align`), so nothing is read back to the host. Groups start at multiples of `align`."""
    device = counts.device
    counts = counts.to(torch.int64)
    aligned = (counts + align - 1) // align * align
    aligned_start = torch.cumsum(aligned, 0) - aligned
    end = torch.cumsum(counts, 0)
    ends = aligned_start + counts
    order = torch.arange(rows, device=device)
    group_of_row = torch.searchsorted(end, order, right=True)  # len(counts) for a padding row
    shift = torch.cat([aligned_start - (end - counts), (ends[-1:] - end[-1:])])  # the last: the padding rows'
    place = order + shift[group_of_row]
    bound = -(-(rows + counts.numel() * (align - 1)) // align) * align
    source = torch.zeros(bound, dtype=torch.int64, device=device)
    source.index_copy_(0, place, order if row_index is None else row_index.to(torch.int64))
    return source, place, ends.to(torch.int32)


def _rows_as_words(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor's rows as 8-byte words where they divide evenly (a gather then moves words, not bytes)."""
    if t.is_contiguous() and (t.shape[1] * t.element_size()) % 8 == 0:
        return t.view(torch.int64)
    return t


def take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`t[index]` along rows, moving whole rows as 8-byte words where they divide evenly."""
    words = _rows_as_words(t)
    return words.index_select(0, index).view(t.dtype) if words is not t else t.index_select(0, index)


def deep_gemm_grouped(
    module: ModuleType,
    x: QuantizedTensor,
    weight: QuantizedWeight,
    counts: torch.Tensor,
    row_index: torch.Tensor | None,
    *,
    finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = take,
) -> torch.Tensor:
    """DeepGEMM's grouped product of a call that `deep_gemm_fits`, in bf16, rows sorted by group: x's rows
    (through `row_index` where given) placed at aligned rows, multiplied, and brought back by
    `finish(product, place)`: `take` by default; a gated call passes its activation reading the rows through
    `place`, so the product is activated and put back in order in one pass."""
    refuse_recording("DeepGEMM's own kernels (not recorded in a launch plan)")
    if x.scale is None or weight.scale is None:
        raise InvalidInput("deep_gemm_grouped: fp8 block-128 rows and weights need their scales (see deep_gemm_fits)")
    return deep_gemm_rows(module, x.data, x.scale, weight.data, weight.scale, counts, row_index, finish=finish)


def deep_gemm_rows(
    module: ModuleType,
    data: torch.Tensor,
    scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    counts: torch.Tensor,
    row_index: torch.Tensor | None,
    *,
    finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = take,
) -> torch.Tensor:
    """`deep_gemm_grouped` on plain tensors: fp8 rows `data` `[M, K]` with `[M, K/128]` scales, K-major fp8
    weights `w` `[E, K, N]` with `[E, K/128, N/128]` scales (what `hal tune` times)."""
    rows = data.shape[0] if row_index is None else row_index.numel()
    n = w.shape[2]
    if rows == 0:
        empty = torch.empty(0, dtype=torch.int64, device=data.device)
        return finish(torch.empty(0, n, dtype=torch.bfloat16, device=data.device), empty)
    align = getattr(module, "get_mk_alignment_for_contiguous_layout", lambda: ALIGN_ROWS)()
    source, place, ends = aligned_layout(counts, rows, row_index, align)
    a, a_scale = take(data.contiguous(), source), scale.contiguous().index_select(0, source)
    out = torch.empty(source.numel(), n, dtype=torch.bfloat16, device=data.device)
    b = (w.transpose(1, 2), w_scale.transpose(1, 2).contiguous())  # [E, N, K] K-major
    module.m_grouped_fp8_gemm_nt_contiguous((a, a_scale), b, out, ends, use_psum_layout=True)
    return finish(out, place)
