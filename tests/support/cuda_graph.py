"""Capturing a call in a CUDA graph, as the GPU tests do it: a warm-up on a side stream (kernels
compile and allocations settle outside the capture), then the capture itself."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(call: Callable[[], torch.Tensor], warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`(graph, output)`: `call` captured once after `warmup` calls on a side stream. The output tensor
    is the graph's own: it holds the result of the latest `graph.replay()`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = call()
    return graph, output
