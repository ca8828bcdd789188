"""The search behind `hal tune` on CUDA: time candidate grouped-GEMM configurations per problem and
row count on this device, keep the fastest.

Each (problem, tokens) case is timed on routed row counts (tokens x top-k rows spread over the experts as uniform
top-k routing spreads them; four routings rotated, so that a decode case does not find its few experts' weights in
L2 from the previous call). A candidate's four calls are captured in one CUDA graph and replayed behind a short
device-side sleep, with CUDA events around each replay: the median of `reps` replays, per call. This is how the
layer runs them. (Timing eager calls instead measured the host's launch path at decode: the GPU waited for each
launch inside the timed region, and the ranking was noise.) The search has two rounds: a grid of tile shapes chosen
by rows per touched expert, then the winner's neighbours (the other grid order, one pipeline stage more or less).
bf16 also times `torch._grouped_mm`, fp8 row-wise `torch._scaled_grouped_mm` (sm90), fp8 block-128 DeepGEMM where
it was found (sm90; its first call per shape JIT-compiles, outside the timed replays; a gate/up call is timed with
the activation pass that reads its aligned product back), bf16 quack-kernels' CuTe DSL GEMM where it was found
(sm90; a first projection's rows read through the index, SiLU-GLU a separate pass). The built-in choice is always
timed, so a table records
what tuning gained.

A problem with the experts' activation (the gate/up projection) is searched three ways, each timed with everything
the layer's call does: the Triton kernel with SiLU-GLU in its epilogue (its own grid and neighbours), the plain kernel
followed by the swiglu pass, and for bf16 `torch._grouped_mm` followed by it. The fastest is kept under the problem's
`+silu-glu` key. Such a problem is a first projection: its calls take the tokens and the dispatch's row index as the
layer's do, so the gather is timed where the layer pays it (torch's grouped GEMMs read a gathered copy; the Triton
kernel reads the rows through the index, or a gathered copy). Where the vendor's built-in rule gathers first
(one-byte rows beyond `ONE_BYTE_GATHER_MAX_ROWS_PER_GROUP` per expert), the Triton kernel is also timed reading
through the index: the rule's way is searched in full, then its fastest tiles and the winner's neighbours the other
way. A first projection's Triton entry records which way won (`Choice.gather`), and the vendor runs it that way. A
quantized first projection's tokens are written just before each timed call (the layer's dispatch quantizes them just
before its GEMM, so they start in L2), and that write's own time is taken off. A `deep-gemm` winner records the
fastest other candidate as its `fallback` (run where DeepGEMM is absent); so does a `quack` winner.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import ModuleType

import torch
import triton

from hal import ActivationKind, GemmKind, GemmProblem
from vendors.cuda.deep_gemm_runner import ALIGN_ROWS, wants_deep_gemm
from vendors.cuda.quack_runner import ALIGN_ELEMENTS, Quack
from vendors.cuda.kernels import grouped_gemm as gg
from vendors.cuda.kernels.grouped_gemm_tma import tma_fits
from vendors.cuda.torch_grouped import grouped_mm_aligned, grouped_mm_by_default, scaled_grouped_mm_aligned
from vendors.cuda.tune_case import ROUTINGS, SCALE, Candidate, TuneCase
from vendors.cuda.tuning import (
    DEEP_GEMM,
    GROUPED_MM,
    OPTIONAL,
    QUACK,
    TRITON,
    TRITON_THEN_ACTIVATION,
    Choice,
    TuningTable,
    problem_key,
)

#: The kinds `tune` searches (fp32 is exact and rare: its defaults stay).
TUNABLE = tuple(SCALE)
#: Row-block bands the second round tries (`TileConfig.group_m`), and from how many rows per expert: at
#: 4096 rows per expert (131072 rows) bands of 8 or 32 were 1.02-1.07x faster on an H100 for most tiles
#: (and up to 1.07x slower for others), so the search decides.
GROUP_M_CHOICES = (8, 32)
GROUP_M_MIN_ROWS_PER_EXPERT = 512
#: The TMA kernel's first-round tiles (block-scaled, many rows): 128x64 with one warpgroup was the fastest
#: down projection on an H100 (qwen3-30b-a3b, deepseek-v3-ep8), the others the runners-up.
TMA_GRID = ((128, 64, 128, 4, 3), (64, 128, 128, 4, 3), (128, 64, 128, 8, 3), (128, 128, 128, 8, 3))
#: How many of the fastest tiles of the rule's way a first projection re-times the other way.
OTHER_WAY_TILES = 4


def candidates(rows_per_expert: float, one_byte: bool, block_scaled: bool, tma: bool = False) -> list[gg.TileConfig]:
    """The first round's grid for a case with `rows_per_expert` rows per touched expert (`tma`: the case's
    rows are contiguous, so block-scaled tiles are also tried on the TMA kernel from 48 rows per expert)."""
    ks = (128,) if block_scaled else ((128, 256) if one_byte else (64, 128))
    if rows_per_expert <= 8:
        grid = [(16, bn, bk, 4, 4) for bn in (32, 64, 128) for bk in ks]
    elif rows_per_expert <= 48:
        grid = [(bm, bn, bk, 4, 3) for bm in (16, 32, 64) for bn in (64, 128) for bk in ks]
    else:
        grid = [(bm, bn, bk, w, 3) for bm in (64, 128) for bn in (128, 256) for bk in ks for w in (4, 8)]
    many = rows_per_expert > 48
    out = [gg.TileConfig(*c, n_fastest=many) for c in grid]
    if tma and block_scaled and many:
        out += [gg.TileConfig(*c, n_fastest=True, tma=True) for c in TMA_GRID]
    return out


def neighbours(best: gg.TileConfig, rows_per_expert: float = 0.0) -> list[gg.TileConfig]:
    """The second round: the winner in the other grid order, with one stage more or less, and (from
    `GROUP_M_MIN_ROWS_PER_EXPERT` rows per expert) in bands of `GROUP_M_CHOICES` row blocks."""
    out = [replace(best, n_fastest=not best.n_fastest, group_m=1)]
    for stages in (best.stages - 1, best.stages + 1):
        if 2 <= stages <= 6:
            out.append(replace(best, stages=stages))
    if rows_per_expert >= GROUP_M_MIN_ROWS_PER_EXPERT:
        out += [replace(best, group_m=g) for g in GROUP_M_CHOICES if g != best.group_m]
    return out


def tune(
    problems: Sequence[GemmProblem],
    device: torch.device,
    device_name: str,
    *,
    grouped_mm: bool,
    scaled_grouped_mm: bool = False,
    deep_gemm: ModuleType | None = None,
    quack: Quack | None = None,
    reps: int = 12,
    progress: Callable[[str], None] | None = None,
) -> TuningTable:
    """Search every problem's token counts on `device`; the table of the fastest choices. `grouped_mm` /
    `scaled_grouped_mm`: torch._grouped_mm (bf16) / torch._scaled_grouped_mm (fp8 row-wise) run here;
    `deep_gemm`: DeepGEMM's module where it was found (`vendors.cuda.deep_gemm_runner.find_deep_gemm`), timed
    for fp8 block-128 problems; `quack`: quack-kernels' GEMM where it was found (`vendors.cuda.quack_runner`),
    timed for bf16 problems (imported only where one is tuned)."""
    say = progress or (lambda _line: None)
    quack_gemm = quack.gemm() if quack is not None and any(map(_quack_serves, problems)) else None
    generator = torch.Generator().manual_seed(0)
    table = TuningTable(
        device_name,
        meta={
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "reps": reps,
            "timing": f"median of {reps} CUDA-graph replays of {ROUTINGS} routings",
            **({"deep_gemm": getattr(deep_gemm, "__version__", "?")} if deep_gemm is not None else {}),
            **({"quack": quack.version} if quack is not None and quack_gemm is not None else {}),
        },
    )
    total = sum(len(p.tokens) for p in problems)
    done = 0
    for problem in problems:
        if problem.kind not in TUNABLE:
            raise ValueError(f"hal tune: the CUDA vendor tunes {', '.join(map(str, TUNABLE))}, not {problem.kind}")
        if problem.activation not in (None, ActivationKind.SILU_GLU):
            raise ValueError(
                f"hal tune: the CUDA vendor fuses only the {ActivationKind.SILU_GLU} activation, "
                f"not {problem.activation}"
            )
        activation = problem.activation is not None
        if activation and problem.n % 2:
            raise ValueError(f"hal tune: a problem with {problem.activation} needs an even N, got {problem.n}")
        key = problem_key(
            problem.kind.value, problem.experts, problem.k, problem.n, problem.activation.value if activation else None
        )
        by_rows = table.entries.setdefault(key, {})
        torch_serves = _torch_serves(problem, grouped_mm, scaled_grouped_mm)
        module = deep_gemm if _deep_gemm_serves(problem) else None
        for tokens in problem.tokens:
            done += 1
            case = TuneCase(problem, tokens, device, generator, module, quack_gemm if _quack_serves(problem) else None)
            timed = _search(case, problem, reps, activation, torch_serves)
            default = _builtin(case, problem, activation, torch_serves)
            without = _builtin(case, problem, activation, torch_serves, deep_gemm=False)
            best = min(timed, key=timed.__getitem__)
            by_rows[case.rows] = _recorded(case, timed, best, default, without)
            backend, tiles, _ = best
            gather = by_rows[case.rows].gather
            count = f"[{done}/{total}] " if total > 1 else ""  # `hal tune` asks one case at a time and counts
            way = "" if gather is None else (" on gathered rows" if gather else " through the row index")
            say(
                f"{count}{key} tokens {tokens} (M={case.rows}): {timed[best]:.1f} us with {backend} "
                f"{tiles or ''}{way} (built-in {timed.get(default, float('nan')):.1f} us; {len(timed)} timed)"
            )
            del case
            torch.cuda.empty_cache()
    return table


def _torch_serves(problem: GemmProblem, grouped_mm: bool, scaled_grouped_mm: bool) -> bool:
    """Whether torch's grouped GEMM runs the problem: torch._grouped_mm (bf16), torch._scaled_grouped_mm (fp8
    row-wise), each where it runs here and the problem's K and N are aligned for it."""
    if problem.kind is GemmKind.BF16:
        return grouped_mm and grouped_mm_aligned(problem.k, problem.n)
    if problem.kind is GemmKind.FP8_ROWWISE:
        return scaled_grouped_mm and scaled_grouped_mm_aligned(problem.k, problem.n)
    return False


def _recorded(
    case: TuneCase, timed: dict[Candidate, float], best: Candidate, default: Candidate, without: Candidate
) -> Choice:
    """The table entry for a case's `best` candidate, with the built-in choice's time (`default`); an optional
    library's (`deep-gemm`, `quack`) with the fastest candidate of the others as its fallback (against `without`,
    the built-in choice sans DeepGEMM)."""
    backend, tiles, through_index = best
    gather = None if tiles is None or not case.first else not through_index
    choice = Choice(backend, None if tiles is None else tuple(tiles.as_list()), timed[best], timed.get(default), gather)
    others = [c for c in timed if c[0] not in OPTIONAL]
    if backend in OPTIONAL and others:
        return replace(choice, fallback=_recorded(case, timed, min(others, key=timed.__getitem__), without, without))
    return choice


def _deep_gemm_serves(problem: GemmProblem) -> bool:
    """Whether DeepGEMM's grouped GEMM takes the problem's operands (fp8 block-128, K and N multiples of 128;
    the case's operands are made as `deep_gemm_fits` wants them)."""
    return problem.kind is GemmKind.FP8_BLOCK128 and problem.k % ALIGN_ROWS == 0 and problem.n % ALIGN_ROWS == 0


def _quack_serves(problem: GemmProblem) -> bool:
    """Whether quack's GEMM takes the problem's operands (bf16, K and N multiples of `ALIGN_ELEMENTS`)."""
    return problem.kind is GemmKind.BF16 and problem.k % ALIGN_ELEMENTS == 0 and problem.n % ALIGN_ELEMENTS == 0


def _builtin(
    case: TuneCase, problem: GemmProblem, activation: bool, torch_serves: bool, deep_gemm: bool = True
) -> Candidate:
    """What `CudaOps` runs for this case without a table (`deep_gemm` False: where DeepGEMM is absent)."""
    if (
        deep_gemm
        and case.deep_gemm is not None
        and wants_deep_gemm(None, problem.kind, case.rows, problem.experts, problem.k, problem.n)
    ):
        return DEEP_GEMM, None, case.first
    if torch_serves and grouped_mm_by_default(case.rows, problem.experts, problem.kind):
        return GROUPED_MM, None, False
    block_scaled = case.scale_mode == gg.SCALE_BLOCK128
    tma = block_scaled and tma_fits(
        case.x, case.w, block_n=64, block_k=128, gated=activation, gathered=case.through_index
    )
    tiles = gg.default_tiles(
        case.rows,
        problem.n // 2 if activation else problem.n,
        problem.experts,
        case.x.element_size(),
        block_scaled,
        gated=activation,
        tma=tma,
    )
    return TRITON, tiles, case.through_index


def _search(
    case: TuneCase, problem: GemmProblem, reps: int, activation: bool, torch_serves: bool
) -> dict[Candidate, float]:
    """Every candidate timed for one case: the built-in choice, the grid and the winner's neighbours for
    each Triton backend (with an activation: in the epilogue, and before the separate pass), and
    torch's grouped GEMM where it serves the kind. Where the built-in rule gathers a first projection's
    rows, the fastest `OTHER_WAY_TILES` tiles of each Triton backend and the winner's neighbours are
    re-timed reading the rows through the index."""
    one_byte = case.x.element_size() == 1
    block_scaled = case.scale_mode == gg.SCALE_BLOCK128
    timed: dict[Candidate, float] = {}

    def time(choices: list[Candidate]) -> None:
        for choice in choices:
            if choice not in timed and (t := case.time_us(choice, reps, activation)) is not None:
                timed[choice] = t

    def runnable(choice: Candidate) -> bool:  # a TMA tile the call would run with pointer loads
        backend, tiles, through_index = choice
        return (
            tiles is None
            or not tiles.tma
            or tma_fits(
                case.x,
                case.w,
                block_n=tiles.block_n,
                block_k=tiles.block_k,
                gated=activation and backend == TRITON,
                gathered=through_index,
            )
        )

    def best_of(backend: str, through_index: bool) -> gg.TileConfig | None:
        tiled = [c for c in timed if c[0] == backend and c[2] == through_index]
        return min(tiled, key=timed.__getitem__)[1] if tiled else None

    time([_builtin(case, problem, activation, torch_serves), _builtin(case, problem, activation, torch_serves, False)])
    # Rows the kernel does not read through an index are contiguous: TMA can read them.
    rule = case.through_index
    backends = (TRITON, TRITON_THEN_ACTIVATION) if activation else (TRITON,)
    for backend in backends:
        grid = candidates(case.rows_per_expert, one_byte, block_scaled, tma=not rule)
        time([c for c in ((backend, t, rule) for t in grid) if runnable(c)])
        if (best := best_of(backend, rule)) is not None:
            time([c for c in ((backend, t, rule) for t in neighbours(best, case.rows_per_expert)) if runnable(c)])
    if case.both_ways:
        for backend in backends:
            ranked = sorted((c for c in timed if c[0] == backend and c[2] == rule), key=timed.__getitem__)
            fastest = list(dict.fromkeys(replace(t, tma=False) for _, t, _ in ranked))[:OTHER_WAY_TILES]
            time([(backend, t, not rule) for t in fastest])  # type: ignore[misc]
            if (best := best_of(backend, not rule)) is not None:
                time(
                    [c for c in ((backend, t, not rule) for t in neighbours(best, case.rows_per_expert)) if runnable(c)]
                )
    if torch_serves:
        time([(GROUPED_MM, None, False)])
    if case.deep_gemm is not None:
        time([(DEEP_GEMM, None, case.first)])
    if case.quack is not None:
        time([(QUACK, None, case.first)])
    if not timed:
        raise RuntimeError(f"hal tune: no candidate configuration ran for {problem} at M={case.rows}")
    return timed
