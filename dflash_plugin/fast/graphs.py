"""CUDA-graph capture and replay of zero-argument step functions.

A *step* reads and writes only persistent (static) tensors, so its graph can be replayed every
round. Graphs are captured lazily, keyed by name and shape, and share one memory pool (steps run
one after another on one stream). Off CUDA, or with graphs disabled, a step just runs eagerly.
`_event` / `_sync`: timing events and host syncs that also work off CUDA.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


class StepGraphs:
    def __init__(self, device: torch.device, enabled: bool = True,
                 capture_error_mode: str = "global"):
        """`capture_error_mode` as `torch.cuda.graph`'s: "thread_local" inside an engine whose
        other threads may touch CUDA while this thread captures."""
        self.enabled = enabled and device.type == "cuda"
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_error_mode = capture_error_mode

    def run(self, key: tuple, fn: Callable[[], None], restore: Sequence[torch.Tensor] = ()) -> None:
        """Replay the graph of `fn` (capturing it on first use). `restore` lists state tensors
        that `fn` mutates: the eager warm-up before capture must not advance them."""
        if not self.enabled:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(fn, restore)
        graph.replay()

    def _capture(self, fn, restore) -> torch.cuda.CUDAGraph:
        saved = [t.clone() for t in restore]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: cuBLAS handles, allocator, lazy init
            fn()
        torch.cuda.current_stream().wait_stream(side)
        for t, v in zip(restore, saved):
            t.copy_(v)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.capture_error_mode):
            fn()
        return graph


def time_step(fn: Callable[[], None], device: torch.device, iters: int = 50,
              graphs: bool = True) -> float:
    """Mean milliseconds of one call of `fn` (CUDA events; replayed as a graph when `graphs`).
    `fn` must be safe to repeat (it may only write stale cache slots and output buffers)."""
    runner = StepGraphs(device, graphs)
    runner.run(("timed",), fn)  # capture (+ warm-up)
    for _ in range(3):
        runner.run(("timed",), fn)
    if device.type != "cuda":  # eager, host clock (tests / CPU smoke runs)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        runner.run(("timed",), fn)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


class _HostEvent:
    """Stand-in for `torch.cuda.Event` off CUDA (where every op is synchronous)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:  # milliseconds, like CUDA events
        return (end.t - self.t) * 1e3


def _event(device):
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else _HostEvent()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
