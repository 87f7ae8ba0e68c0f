"""One CUDA graph per batch bucket for a phase of DFLASH_TREE's round (no SGLang import here).

A phase whose tensors' shapes depend on the batch size only (the tree phase, the drafter-KV
append) copies each round's inputs into static buffers of the batch's bucket (`bucket`: 1, 2, 4,
8, then multiples of 8) and replays that bucket's graph (`fast.graphs.StepGraphs`, thread-local
capture errors: SGLang's other threads keep running). The rows past the batch hold whatever an
earlier round left there (or zeros): a phase must keep every row independent and make padded rows
harmless. The worker captures every bucket up to its running-request limit at start-up (`warm`):
captured on first use instead, the H200's 8-request rows (requests finishing one by one: batches
8, 7, ... 1) spent their time capturing, 2,093 tok/s against 3,095 eager (2026-12-02). Off CUDA,
with `DFLASH_TREE_GRAPHS=0`, or after a failed capture (logged once), a phase runs eagerly, with
the same results.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

from ..errors import env_flag
from ..fast.graphs import StepGraphs

logger = logging.getLogger(__name__)

ENV = "DFLASH_TREE_GRAPHS"
WARM_MAX_BS = 256  # start-up captures stop here (35 graphs); larger buckets: on first use


def graphs_enabled(environ=os.environ) -> bool:
    """`DFLASH_TREE_GRAPHS`: 1 (default) or 0; a clear error otherwise."""
    return env_flag(environ, ENV, "1", "capture the tree phase in CUDA graphs")


def bucket_limit(server_args) -> int:
    """The most requests a step can hold (0: unknown), the last batch bucket to capture."""
    limit = getattr(server_args, "max_running_requests", None) or \
        getattr(server_args, "cuda_graph_max_bs_decode", None)
    return int(limit or 0)


def bucket(bs: int) -> int:
    """The graph batch size that holds `bs` rows: 1, 2, 4, 8, then the next multiple of 8."""
    if bs < 1:
        raise ValueError(f"batch size must be >= 1, got {bs}")
    return 1 << (bs - 1).bit_length() if bs <= 8 else -(-bs // 8) * 8


def warm_buckets(max_bs: int) -> list[int]:
    """The buckets `warm` captures for a running-request limit of `max_bs`."""
    return sorted({bucket(b) for b in range(1, min(max_bs, WARM_MAX_BS) + 1)})


class BucketGraphs:
    """`load(tensors)` copies `[bs, ...]` inputs into their bucket's static buffers; `run(pad,
    fn)` replays (capturing on first use) the graph of `fn`, which reads those buffers.
    `bucket_of(rows)` pads a row count (default `bucket`). `keep()` (optional) names tensors
    a captured graph uses but does not own (an engine's workspace that it may reallocate
    later): they are held for as long as the graphs live.
    `reserve(rows)`: every bucket up to `rows` loads into views of one set of buffers. A graph
    reads its inputs only during its own replay, and replays run one at a time on one stream,
    so buckets can share them; without it each larger bucket allocated its own (at 256
    running requests, 35 buckets: the sum of their sizes instead of the largest)."""

    def __init__(self, device: torch.device, name: str, enabled: bool = True,
                 keep: Callable[[], Sequence[torch.Tensor]] | None = None,
                 bucket_of: Callable[[int], int] = bucket):
        self.name, self.keep, self.bucket_of = name, keep, bucket_of
        self.graphs = StepGraphs(device, enabled, capture_error_mode="thread_local")
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.held: list[torch.Tensor] = []
        self.rows = 0  # rows of the shared buffers (`reserve`)
        self._shared: list[torch.Tensor] | None = None

    @property
    def enabled(self) -> bool:
        return self.graphs.enabled

    def reserve(self, rows: int) -> None:
        self.rows = max(self.rows, rows)

    def load(self, tensors: Sequence[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        """The bucket of `tensors[0].shape[0]` rows and its buffers, first rows = `tensors`."""
        bs = int(tensors[0].shape[0])
        pad = self.bucket_of(bs)
        have = self.inputs.get(pad)
        if have is None or _differ(have, tensors):
            shared = self._shared
            if shared is None or _differ(shared, tensors) or shared[0].shape[0] < pad:
                rows = max(pad, self.rows)
                shared = self._shared = [t.new_zeros((rows, *t.shape[1:])) for t in tensors]
            have = self.inputs[pad] = [b[:pad] for b in shared]
            self.graphs.graphs.pop((pad,), None)  # new buffers: capture again
        for b, t in zip(have, tensors):
            b[:bs].copy_(t)
        return pad, have

    def run(self, pad: int, fn: Callable[[], None]) -> None:
        new = (pad,) not in self.graphs.graphs
        try:
            self.graphs.run((pad,), fn)
        except RuntimeError as e:
            if not self.graphs.enabled:
                raise
            logger.warning("DFLASH_TREE: capturing the %s phase in a CUDA graph failed (%s); it "
                           "runs eagerly from now on", self.name, e)
            self.graphs.enabled = False
            self.graphs.graphs.clear()
            fn()
            return
        if new and self.graphs.enabled and self.keep is not None:
            held = {id(t) for t in self.held}
            self.held += [t for t in self.keep() if t is not None and id(t) not in held]


def _differ(buffers: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> bool:
    return len(buffers) != len(tensors) or any(
        b.shape[1:] != t.shape[1:] or b.dtype != t.dtype for b, t in zip(buffers, tensors))
