"""A CUDA graph timer shared by the kernel tools (each runs as a script from this folder, which is on its path)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def graph_us(work: Callable[[], Tensor], replays: int = 5, rounds: int = 7) -> tuple[float, Tensor]:
    """Median µs of one replay of ``work`` captured in a CUDA graph (``replays`` per timed round), and its output."""
    work()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = work()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays * 1e3)
    return sorted(times)[rounds // 2], out
