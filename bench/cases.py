"""One benchmark case: a model shape at a token count and precision, timed every way."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from bench.baselines import direct_forward, per_expert_loop
from bench.ceilings import Ceilings
from bench.shapes import PRECISIONS, ModelShape, peak_of
from bench.timing import NOISY_SPREAD, DeviceTimer, repeats_for, stable_median_us, wall_us
from hal import Vendor
from moe import GraphConfig, MoELayer
from moe.routing_traces import RoutingTrace

#: Input sets cycled through, so that no repeat reads the previous one's activations from cache.
ROTATING_INPUTS = 4


@dataclass
class CaseResult:
    """The measurements of one case (times in microseconds, medians)."""

    model: str
    tokens: int
    precision: str
    eager_us: float
    direct_eager_us: float
    loop_us: float | None = None
    graph_us: float | None = None
    direct_graph_us: float | None = None
    touched_experts: float = 0.0
    weight_bytes: float = 0.0
    flops: float = 0.0
    roofline_us: float | None = None
    #: wall time per call of back-to-back calls (one synchronisation): the eager layer (its launch plans on), and the
    #: layer replaying its own captures (`moe.GraphConfig`) where the vendor captures graphs
    eager_wall_us: float | None = None
    replayed_wall_us: float | None = None
    #: spread of the eager time's round medians (max / min - 1); above `bench.timing.NOISY_SPREAD`: noisy
    eager_spread: float = 0.0

    @property
    def noisy(self) -> bool:
        """Whether the eager time still varied between rounds after the repeats allowed."""
        return self.eager_spread > NOISY_SPREAD

    @property
    def best_us(self) -> float:
        """The layer's time as an engine runs it: graph replay where there is one."""
        return self.graph_us if self.graph_us is not None else self.eager_us

    def derived(self) -> dict[str, float | None]:
        """Bandwidth, throughput, roofline fractions and ratios; the achieved rates only where the device's
        ceilings were measured (None elsewhere: a host clock's rates on a tiny shape say nothing)."""
        best = self.best_us * 1e-6
        measured = self.roofline_us is not None
        return {
            "weight_GBps": self.weight_bytes / best / 1e9 if measured else None,
            "TFLOPs": self.flops / best / 1e12 if measured else None,
            "roofline_fraction_graph": _ratio(self.roofline_us, self.graph_us),
            "roofline_fraction_eager": _ratio(self.roofline_us, self.eager_us),
            "overhead_eager": _ratio(self.eager_us, self.direct_eager_us),
            "overhead_graph": _ratio(self.graph_us, self.direct_graph_us),
            "speedup_vs_loop": _ratio(self.loop_us, self.best_us),
            "eager_wall_vs_graph": _ratio(self.eager_wall_us, self.graph_us),
            "replayed_wall_vs_graph": _ratio(self.replayed_wall_us, self.graph_us),
        }

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON: the measurements and what follows from them."""
        return {**asdict(self), **self.derived()}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


class ShapeBench:
    """The layers of one model shape on one vendor (built once, used for every token count)."""

    def __init__(
        self,
        vendor: Vendor,
        shape: ModelShape,
        precisions: list[str],
        seed: int = 0,
        routing: RoutingTrace | None = None,
    ) -> None:
        self.vendor, self.shape = vendor, shape
        self.routing = routing  #: the router logits' pattern (None: standard normal logits)
        device = vendor.device
        g = torch.Generator(device=device).manual_seed(seed)
        e, h, i = shape.experts, shape.hidden, shape.intermediate
        w13 = torch.randn(e, h, 2 * i, device=device, generator=g, dtype=torch.bfloat16) / math.sqrt(h)
        w2 = torch.randn(e, i, h, device=device, generator=g, dtype=torch.bfloat16) / math.sqrt(i)
        self.loop_weights = (w13, w2)  # bf16, for the per-expert loop
        self.layers = {
            p: MoELayer.from_float(w13, w2, shape.top_k, scheme=PRECISIONS[p], vendor=vendor) for p in precisions
        }
        self._weights = (w13, w2)
        self._replaying: dict[str, MoELayer] = {}

    def replaying(self, precision: str, tokens: int) -> MoELayer | None:
        """The layer of `precision` replaying its own captures (None where the vendor captures no graphs);
        built on first use (a second copy of the weights)."""
        if not self.vendor.capabilities().graph_capture:
            return None
        layer = self._replaying.get(precision)
        if layer is None or layer.graph_config.max_tokens < tokens:  # type: ignore[union-attr]
            w13, w2 = self._weights
            config = GraphConfig(max_tokens=max(tokens, 512), max_graphs=ROTATING_INPUTS * 16)
            layer = MoELayer.from_float(
                w13, w2, self.shape.top_k, scheme=PRECISIONS[precision], vendor=self.vendor, graphs=config
            )
            self._replaying[precision] = layer
        return layer

    def inputs(self, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`ROTATING_INPUTS` (x, router logits) pairs."""
        device = self.vendor.device
        g = torch.Generator(device=device).manual_seed(tokens)
        sets = []
        for i in range(ROTATING_INPUTS):
            x = torch.randn(tokens, self.shape.hidden, device=device, generator=g).to(torch.bfloat16)
            if self.routing is None:
                logits = torch.randn(tokens, self.shape.experts, device=device, generator=g)
            else:
                logits = self.routing.logits(tokens, self.shape.experts, seed=tokens + i, device=str(device))
            sets.append((x, logits))
        return sets

    def run(
        self, precision: str, tokens: int, timer: DeviceTimer, ceilings: Ceilings | None, graphs: bool
    ) -> CaseResult:
        """Time the case eagerly, through the direct kernels, the per-expert loop and (if `graphs`) graph replay."""
        layer = self.layers[precision]
        sets = self.inputs(tokens)
        layer_call = _rotating(lambda x, r: layer(x, r), sets)
        direct_call = _rotating(lambda x, r: direct_forward(self.vendor, layer, x, r), sets)
        w13, w2 = self.loop_weights
        loop_call = _rotating(lambda x, r: per_expert_loop(x, r, w13, w2, self.shape.top_k), sets)
        estimate = timer.median_us(layer_call, warmup=2, repeats=3)
        repeats = repeats_for(estimate)
        eager, spread = stable_median_us(timer, layer_call, warmup=3, repeats=repeats)
        result = CaseResult(
            self.shape.name,
            tokens,
            precision,
            eager_us=eager,
            eager_spread=spread,
            direct_eager_us=timer.median_us(direct_call, warmup=3, repeats=repeats),
            loop_us=timer.median_us(loop_call, warmup=1, repeats=max(5, repeats // 4)),
        )
        if graphs:
            result.graph_us = timer.median_us(_graphed(layer_call, len(sets)), warmup=5, repeats=max(repeats, 50))
            result.direct_graph_us = timer.median_us(
                _graphed(direct_call, len(sets)), warmup=5, repeats=max(repeats, 50)
            )
        result.eager_wall_us = wall_us(timer, layer_call)
        replaying = self.replaying(precision, tokens)
        if replaying is not None:
            result.replayed_wall_us = wall_us(timer, _rotating(lambda x, r: replaying(x, r), sets))
        self._roofline(result, layer, sets, ceilings)
        return result

    def _roofline(self, result: CaseResult, layer: MoELayer, sets: list, ceilings: Ceilings | None) -> None:
        """Touched experts' weight bytes and the GEMM flops; the roofline time where ceilings exist."""
        weights = layer.expert_weights
        per_expert = (
            sum(t.numel() * t.element_size() for w in (weights.w13, weights.w2) for t in w.tensors().values())
            / self.shape.experts
        )
        touched = [layer.router(r).topk_ids.unique().numel() for _, r in sets]
        result.touched_experts = sum(touched) / len(touched)
        result.weight_bytes = result.touched_experts * per_expert
        h, i = self.shape.hidden, self.shape.intermediate
        result.flops = 2.0 * result.tokens * self.shape.top_k * (h * 2 * i + i * h)
        if ceilings is not None:
            peak = ceilings.matmul_flops_per_s.get(peak_of(result.precision), ceilings.matmul_flops_per_s["bf16"])
            result.roofline_us = max(result.weight_bytes / ceilings.copy_bytes_per_s, result.flops / peak) * 1e6


def _rotating(fn: Callable[[torch.Tensor, torch.Tensor], object], sets: list) -> Callable[[int], object]:
    return lambda i: fn(*sets[i % len(sets)])


def _graphed(call: Callable[[int], object], count: int) -> Callable[[int], object]:
    """One CUDA graph per input set, captured after a warm-up on a side stream; replayed in turn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(count):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for i in range(count):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(i)
        graphs.append(graph)
    return lambda i: graphs[i % count].replay()
