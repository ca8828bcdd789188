"""The search behind `hal tune` on CUDA: time candidate grouped-GEMM configurations per problem and
row count on this device, keep the fastest.

Each (problem, tokens) case is timed on routed row counts (tokens x top-k rows spread over
the experts as uniform top-k routing spreads them; four routings rotated, so that a decode
case does not find its few experts' weights in L2 from the previous call). A candidate's
four calls are captured in one CUDA graph and replayed behind a short device-side sleep,
with CUDA events around each replay: the median of `reps` replays, per call. This is how
the layer runs them. (Timing eager calls instead measured the host's launch path at decode:
the GPU waited for each launch inside the timed region, and the ranking was noise.) The
search has two rounds: a grid of
tile shapes chosen by rows per touched expert, then the winner's neighbours (the other
grid order, one pipeline stage more or less). bf16 also times `torch._grouped_mm`, fp8 row-wise
`torch._scaled_grouped_mm` (sm90). The
built-in choice is always timed, so a table records what tuning gained.

A problem with the experts' activation (the gate/up projection) is searched three ways, each
timed with everything the layer's call does: the Triton kernel with SiLU-GLU in its epilogue
(its own grid and neighbours), the plain kernel followed by the swiglu pass, and for bf16
`torch._grouped_mm` followed by it. The fastest is kept under the problem's `+silu-glu` key.
Such a problem is a first projection: its calls take the tokens and the dispatch's row index as
the layer's do, so the gather is timed where the layer pays it (torch's grouped GEMMs read a gathered
copy; the Triton kernel reads the rows through the index, or a gathered copy). Where the vendor's
built-in rule gathers first (one-byte rows beyond `ONE_BYTE_GATHER_MAX_ROWS_PER_GROUP` per expert),
the Triton kernel is also timed reading through the index: the rule's way is searched in full, then
its fastest tiles and the winner's neighbours the other way. A first projection's Triton entry
records which way won (`Choice.gather`), and the vendor runs it that way. A quantized first projection's
tokens are written just before each timed call (the layer's dispatch quantizes them just before its GEMM, so
they start in L2), and that write's own time is taken off.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import triton

from hal import ActivationKind, GemmKind, GemmProblem, reference
from vendors.cuda.kernels import activation as act
from vendors.cuda.kernels import grouped_gemm as gg
from vendors.cuda.kernels.grouped_gemm_tma import tma_fits
from vendors.cuda.ops import gather_in_gemm
from vendors.cuda.torch_grouped import (
    grouped_mm_aligned,
    grouped_mm_by_default,
    scaled_grouped_mm,
    scaled_grouped_mm_aligned,
)
from vendors.cuda.tuning import GROUPED_MM, TRITON, TRITON_THEN_ACTIVATION, Choice, TuningTable, problem_key

_SCALE = {
    GemmKind.BF16: gg.SCALE_NONE,
    GemmKind.FP16: gg.SCALE_NONE,
    GemmKind.INT8: gg.SCALE_ROWWISE,
    GemmKind.FP8_ROWWISE: gg.SCALE_ROWWISE,
    GemmKind.FP8_BLOCK128: gg.SCALE_BLOCK128,
}
#: The kinds `tune` searches (fp32 is exact and rare: its defaults stay).
TUNABLE = tuple(_SCALE)
_ROUTINGS = 4
#: About 20 us of device-side sleep before each timed replay (cycles at ~2 GHz).
_SLEEP_CYCLES = 40_000
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
#: A candidate: (backend, tiles, through_index); tiles None for torch._grouped_mm; `through_index`: a first
#: projection's Triton kernel reads its rows through the routing's index (else from a gathered copy).
Candidate = tuple[str, "gg.TileConfig | None", bool]


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


class _Case:
    """The operands of one (problem, tokens) case on the device, and a timer over its routings."""

    def __init__(self, problem: GemmProblem, tokens: int, device: torch.device, generator: torch.Generator) -> None:
        self.kind = problem.kind
        e, k, n, top_k = problem.experts, problem.k, problem.n, problem.top_k
        self.rows = tokens * top_k
        # A problem with the experts' activation is a first projection: the layer hands it the tokens and the
        # dispatch's row index (the token of each row sorted by expert), and each call reads its rows as the layer's
        # does (through the index, or gathered first), so that choices pay for the gather where the layer does.
        self.first = problem.activation is not None
        self.counts, self.index = [], []
        for _ in range(_ROUTINGS):
            picks = torch.rand(tokens, e, generator=generator).topk(top_k, dim=1).indices.reshape(-1)
            self.counts.append(torch.bincount(picks, minlength=e).to(device))
            self.index.append((torch.sort(picks, stable=True).indices // top_k).to(torch.int32).to(device))
        self.offsets = [torch.cumsum(c, 0).to(torch.int32) for c in self.counts]
        touched = sum(int((c > 0).sum()) for c in self.counts) / _ROUTINGS
        self.rows_per_expert = self.rows / max(touched, 1.0)
        x = torch.randn(tokens if self.first else self.rows, k, generator=generator).to(device)
        w = (torch.randn(e, k, n, generator=generator) / k**0.5).to(device)
        self.scale_mode = _SCALE[problem.kind]
        if problem.kind in (GemmKind.BF16, GemmKind.FP16):
            dtype = torch.bfloat16 if problem.kind is GemmKind.BF16 else torch.float16
            self.x, self.x_scale = x.to(dtype), None
            self.w, self.w_scale = w.to(dtype), None
        else:
            act = {
                GemmKind.INT8: ("int8", "per-token"),
                GemmKind.FP8_ROWWISE: ("fp8", "per-token"),
                GemmKind.FP8_BLOCK128: ("fp8", "per-token-group-128"),
            }[problem.kind]
            layout, dtype = {
                GemmKind.INT8: ("per-channel", torch.int8),
                GemmKind.FP8_ROWWISE: ("per-channel", torch.float8_e4m3fn),
            }.get(problem.kind, ("block-128x128", None))
            q = reference.quantize(x, *act)
            qw = reference.quantize_weight(w, layout, dtype)
            self.x, self.x_scale = q.data, q.scale
            k_major = qw.data.transpose(1, 2).contiguous().transpose(1, 2)  # as CudaOps.prepare_weight stores it
            self.w, self.w_scale = k_major, qw.scale
        del x, w
        #: The built-in rule: the Triton kernel reads a first projection's rows through the index (else they are
        #: gathered first). Where it gathers, the search also times the Triton kernel reading through the index.
        self.through_index = self.first and gather_in_gemm(self.rows, e, self.x.element_size())
        self.both_ways = self.first and not self.through_index
        #: A quantized first projection reads tokens the layer's dispatch has just written (its quantize pass), so
        #: they sit in L2 when the GEMM (or the gather before it) starts. Each timed call is preceded by a copy that
        #: writes them the same way; the copy's own time is taken off (`_refresh_us`).
        self.refresh = self.first and self.x_scale is not None
        self._fresh = (torch.empty_like(self.x), torch.empty_like(self.x_scale)) if self.refresh else None
        self._refresh_us: float | None = None

    def run(self, choice: Candidate, routing: int, activation: bool) -> torch.Tensor:
        """One call as the layer makes it: the product, and with `activation` its SiLU-GLU (in the epilogue
        for the `triton` backend, a separate pass for the others); a first projection's rows through the
        routing's index, or gathered first (torch._grouped_mm always, the Triton kernel as the candidate says)."""
        backend, tiles, through_index = choice
        x, x_scale, index = self.x, self.x_scale, self.index[routing] if self.first else None
        if self._fresh is not None:
            x, x_scale = self._write_tokens()
        if index is not None and (backend == GROUPED_MM or not through_index):
            x_scale = None if x_scale is None else x_scale.index_select(0, index)
            x, index = x.index_select(0, index), None
        if backend == GROUPED_MM and x_scale is not None:
            y = scaled_grouped_mm(x, x_scale, self.w, self.w_scale, self.offsets[routing])
        elif backend == GROUPED_MM:
            y = torch._grouped_mm(x, self.w, offs=self.offsets[routing], out_dtype=torch.bfloat16)
        else:
            y = gg.grouped_gemm(
                x,
                self.w,
                self.counts[routing],
                torch.bfloat16,
                x_scale=x_scale,
                w_scale=self.w_scale,
                scale_mode=self.scale_mode,
                config=tiles,
                gated=activation and backend == TRITON,
                row_index=index,
            )
        return act.swiglu(y) if activation and backend != TRITON else y

    def _write_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, x_scale = self._fresh  # type: ignore[misc]
        x.copy_(self.x)
        x_scale.copy_(self.x_scale)
        return x, x_scale

    def time_us(self, choice: Candidate, reps: int, activation: bool = False) -> float | None:
        """The median per-call time over `reps` graph replays, less the token write before each call where
        there is one (None: the configuration does not compile or run here)."""
        t = self._replay_us(lambda routing: self.run(choice, routing, activation), reps)
        if t is None or not self.refresh:
            return t
        if self._refresh_us is None:
            self._refresh_us = self._replay_us(lambda _routing: self._write_tokens(), reps) or 0.0
        return max(t - self._refresh_us, 0.0)

    @staticmethod
    def _replay_us(call: Callable[[int], object], reps: int) -> float | None:
        """The median time per call of one CUDA graph of `call(routing)` for each routing (None: it failed)."""
        try:
            for routing in range(_ROUTINGS):  # compile and warm up, outside the capture
                call(routing)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for routing in range(_ROUTINGS):
                    call(routing)
            graph.replay()
            torch.cuda.synchronize()
        except (triton.runtime.errors.OutOfResources, RuntimeError, ValueError):
            torch.cuda.synchronize()
            return None
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(_SLEEP_CYCLES)  # the device is busy while the host enqueues the replay
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / _ROUTINGS)
        del graph
        return statistics.median(times)


def tune(
    problems: Sequence[GemmProblem],
    device: torch.device,
    device_name: str,
    *,
    grouped_mm: bool,
    scaled_grouped_mm: bool = False,
    reps: int = 12,
    progress: Callable[[str], None] | None = None,
) -> TuningTable:
    """Search every problem's token counts on `device`; the table of the fastest choices. `grouped_mm` /
    `scaled_grouped_mm`: torch._grouped_mm (bf16) / torch._scaled_grouped_mm (fp8 row-wise) run here."""
    say = progress or (lambda _line: None)
    generator = torch.Generator().manual_seed(0)
    table = TuningTable(
        device_name,
        meta={
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "reps": reps,
            "timing": f"median of {reps} CUDA-graph replays of {_ROUTINGS} routings",
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
        for tokens in problem.tokens:
            done += 1
            case = _Case(problem, tokens, device, generator)
            timed = _search(case, problem, reps, activation, torch_serves)
            default = _builtin(case, problem, activation, torch_serves)
            backend, tiles, through_index = best = min(timed, key=timed.__getitem__)
            gather = None if tiles is None or not case.first else not through_index
            by_rows[case.rows] = Choice(
                backend, None if tiles is None else tuple(tiles.as_list()), timed[best], timed.get(default), gather
            )
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


def _builtin(case: _Case, problem: GemmProblem, activation: bool, torch_serves: bool) -> Candidate:
    """What `CudaOps` runs for this case without a table."""
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
    case: _Case, problem: GemmProblem, reps: int, activation: bool, torch_serves: bool
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

    time([_builtin(case, problem, activation, torch_serves)])
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
    if not timed:
        raise RuntimeError(f"hal tune: no candidate configuration ran for {problem} at M={case.rows}")
    return timed
