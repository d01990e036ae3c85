"""CUDA-graph capture of a callable: what tools/bench_ops.py times with ``--cuda-graph`` and the
kernel tests replay (``testing.kernels.graph_replay_matches_eager``)."""

from __future__ import annotations

import torch


def capture_cuda_graph(fn, warmup: int = 2):
    """``fn()`` warmed up on a side stream (compiles, allocator pools: torch wants no first-time
    work inside a capture), then captured in a CUDA graph. Returns ``(graph, what the captured
    call returned)``; ``graph.replay()`` reruns the GPU work into those same tensors. Raises if
    ``fn`` cannot be captured (a host sync inside it, for instance)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    return graph, captured
