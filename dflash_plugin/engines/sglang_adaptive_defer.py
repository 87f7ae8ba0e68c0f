"""DFLASH_ADAPTIVE's plain (q = 1) steps write the drafter's context late, many steps at once.

Every decode step of DFLASH's worker appends the verified tokens' target hidden states to the
drafter's KV cache (the drafter's fc projection and each draft layer's K/V, one CUDA graph per
batch bucket): a plain step too, so that a later q > 1 step drafts from a current context. At
the Qwen3-8B shape that append reads the drafter's projection weights for one token per
request, GPU work a plain step inside the worker pays and SGLang's own plain step does not.

`DeferredAppend` holds the q = 1 steps' rows (target hidden, KV slot, position) in device
buffers and hands them back together, so one append writes many steps' tokens (the weights read
once). The worker writes them out before anything can read or reuse those drafter slots:
before a step at q > 1 (its drafter reads the context), before any prefill or other non-decode
forward (a new request's prefill may reuse a finished request's slots), when the batch's
requests change (a finished request's slots are freed), and when the buffer is full. A held
row's slot belongs to a committed token of a running request, freed only when the request
leaves the batch, so between two write-outs no slot is held twice.

`DFLASH_ADAPTIVE_DEFER_APPEND=N` holds up to N tokens (default 1024: one buffer of 1024 target
hidden rows, e.g. 40 MB for 5 captured layers of width 4096 in bf16; 0 turns it off, every step
appending at once, DFLASH's way). On by default since 2026-12-06: on an H100 at the Qwen3-8B
shape it took the q = 1 step from 6.92 to 6.80 ms (1 request) with outputs equal to plain's
(BENCHMARKS.md).
"""

from __future__ import annotations

import os

import torch

ENV = "DFLASH_ADAPTIVE_DEFER_APPEND"
DEFAULT = 1024


def capacity_from_env() -> int:
    """Tokens the buffer holds (0: every step appends at once, DFLASH's way)."""
    raw = os.environ.get(ENV, "").strip() or str(DEFAULT)
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be an integer >= 0 (tokens held), got {raw!r}") from None
    if n < 0:
        raise ValueError(f"{ENV} must be >= 0 (tokens held), got {n}")
    return n


class DeferredAppend:
    """Up to `capacity` rows of (target hidden, drafter KV slot, position), in arrival order."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.n = 0
        self.hidden = self.loc = self.pos = None  # [capacity, h], [capacity], [capacity]

    def fits(self, rows: int) -> bool:
        return self.n + rows <= self.capacity

    def add(self, hidden: torch.Tensor, loc: torch.Tensor, pos: torch.Tensor) -> None:
        """hidden [rows, h], loc [rows], pos [rows]: copied in (device ops, no host sync)."""
        rows = int(hidden.shape[0])
        if not self.fits(rows):
            raise ValueError(f"{rows} rows do not fit: {self.n} of {self.capacity} held")
        if (self.hidden is None or self.hidden.shape[1] != hidden.shape[1]
                or self.hidden.dtype != hidden.dtype or self.hidden.device != hidden.device):
            if self.n:
                raise ValueError("rows of another width, dtype or device while rows are held")
            self.hidden = hidden.new_empty((self.capacity, hidden.shape[1]))
            self.loc = torch.empty(self.capacity, dtype=torch.int64, device=hidden.device)
            self.pos = torch.empty(self.capacity, dtype=torch.int64, device=hidden.device)
        self.hidden[self.n:self.n + rows].copy_(hidden)
        self.loc[self.n:self.n + rows].copy_(loc.reshape(-1))
        self.pos[self.n:self.n + rows].copy_(pos.reshape(-1))
        self.n += rows

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The rows held ([n, h], [n], [n] views of the buffers: use them before the next
        `add`, which the stream orders after their readers) and an empty buffer; None if
        nothing is held."""
        if not self.n:
            return None
        n, self.n = self.n, 0
        return self.hidden[:n], self.loc[:n], self.pos[:n]
