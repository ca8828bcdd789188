"""One `hal tune` case on the device: a (problem, tokens) case's operands, routed as uniform top-k routing spreads
rows, each candidate run as the layer's call runs it, and the CUDA-graph replay timer (see `vendors.cuda.tuner`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from types import ModuleType

import torch
import triton

from hal import GemmKind, GemmProblem, reference
from vendors.cuda.deep_gemm_runner import deep_gemm_rows, take
from vendors.cuda.kernels import activation as act
from vendors.cuda.kernels import grouped_gemm as gg
from vendors.cuda.quack_runner import GemmFn, quack_grouped
from vendors.cuda.row_reading import gather_in_gemm
from vendors.cuda.torch_grouped import scaled_grouped_mm
from vendors.cuda.tuning import DEEP_GEMM, GROUPED_MM, OPTIONAL, QUACK, TRITON

#: The Triton kernel's scale mode per tunable kind.
SCALE = {
    GemmKind.BF16: gg.SCALE_NONE,
    GemmKind.FP16: gg.SCALE_NONE,
    GemmKind.INT8: gg.SCALE_ROWWISE,
    GemmKind.FP8_ROWWISE: gg.SCALE_ROWWISE,
    GemmKind.FP8_BLOCK128: gg.SCALE_BLOCK128,
}
#: Routings per case, rotated so that a decode case does not find its experts' weights in L2.
ROUTINGS = 4
#: About 20 us of device-side sleep before each timed replay (cycles at ~2 GHz).
SLEEP_CYCLES = 40_000
#: A candidate: (backend, tiles, through_index); tiles None for torch's GEMMs, DeepGEMM and quack; `through_index`:
#: a first projection's Triton kernel reads its rows through the routing's index (else from a gathered copy).
Candidate = tuple[str, "gg.TileConfig | None", bool]


class TuneCase:
    """The operands of one (problem, tokens) case on the device, and a timer over its routings."""

    def __init__(
        self,
        problem: GemmProblem,
        tokens: int,
        device: torch.device,
        generator: torch.Generator,
        deep_gemm: ModuleType | None = None,
        quack: GemmFn | None = None,
    ) -> None:
        self.kind = problem.kind
        self.deep_gemm = deep_gemm  #: DeepGEMM's module where the tuner found it serves the problem
        self.quack = quack  #: quack-kernels' GEMM where the tuner found it serves the problem
        e, k, n, top_k = problem.experts, problem.k, problem.n, problem.top_k
        self.rows = tokens * top_k
        # A problem with the experts' activation is a first projection: the layer hands it the tokens and the
        # dispatch's row index (the token of each row sorted by expert), and each call reads its rows as the layer's
        # does (through the index, or gathered first), so that choices pay for the gather where the layer does.
        self.first = problem.activation is not None
        self.counts, self.index = [], []
        for _ in range(ROUTINGS):
            picks = torch.rand(tokens, e, generator=generator).topk(top_k, dim=1).indices.reshape(-1)
            self.counts.append(torch.bincount(picks, minlength=e).to(device))
            self.index.append((torch.sort(picks, stable=True).indices // top_k).to(torch.int32).to(device))
        self.offsets = [torch.cumsum(c, 0).to(torch.int32) for c in self.counts]
        touched = sum(int((c > 0).sum()) for c in self.counts) / ROUTINGS
        self.rows_per_expert = self.rows / max(touched, 1.0)
        x = torch.randn(tokens if self.first else self.rows, k, generator=generator).to(device)
        w = (torch.randn(e, k, n, generator=generator) / k**0.5).to(device)
        self.scale_mode = SCALE[problem.kind]
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
        if backend == DEEP_GEMM:  # places the rows itself (through the index); the activation reads them back
            finish = act.swiglu if activation else take
            counts = self.counts[routing]
            return deep_gemm_rows(self.deep_gemm, x, x_scale, self.w, self.w_scale, counts, index, finish=finish)  # type: ignore[arg-type]
        if backend == QUACK:  # reads the rows through the index itself; the activation a separate pass
            y = quack_grouped(self.quack, x, self.w, self.counts[routing], index)  # type: ignore[arg-type]
            return act.swiglu(y) if activation else y
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
        there is one (None: the configuration does not compile or run here; an optional library's candidate also
        where the library raises anything else, so that its failure skips it instead of ending the search)."""
        try:
            t = self._replay_us(lambda routing: self.run(choice, routing, activation), reps)
        except Exception:
            if choice[0] not in OPTIONAL:
                raise
            torch.cuda.synchronize()
            return None
        if t is None or not self.refresh:
            return t
        if self._refresh_us is None:
            self._refresh_us = self._replay_us(lambda _routing: self._write_tokens(), reps) or 0.0
        return max(t - self._refresh_us, 0.0)

    @staticmethod
    def _replay_us(call: Callable[[int], object], reps: int) -> float | None:
        """The median time per call of one CUDA graph of `call(routing)` for each routing (None: it failed)."""
        try:
            for routing in range(ROUTINGS):  # compile and warm up, outside the capture
                call(routing)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for routing in range(ROUTINGS):
                    call(routing)
            graph.replay()
            torch.cuda.synchronize()
        except (triton.runtime.errors.OutOfResources, RuntimeError, ValueError):
            torch.cuda.synchronize()
            return None
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SLEEP_CYCLES)  # the device is busy while the host enqueues the replay
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / ROUTINGS)
        del graph
        return statistics.median(times)
