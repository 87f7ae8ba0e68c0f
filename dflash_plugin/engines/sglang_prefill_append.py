"""The drafter-KV append of a DFLASH prefill (the prompt's tokens) through CUDA graphs, one per
token bucket: `DFLASH_PREFILL_APPEND` (no SGLang import here).

Why: after the target's prefill, DFLASH writes the prompt's drafter K/V (DFLASH's
`_append_target_hidden_to_draft_kv_by_loc`: the drafter's `fc` projection, then per drafter
layer the K/V projection, k-norm, RoPE and the write at each token's slot) with eager
launches. At the fixture's 32-request row, where a prefill follows about every decode step,
that append was 7.2 % of the adaptive server's scheduler samples (H100, SGLang 0.5.16,
`profile-32`, 2026-12-06; BENCHMARKS.md), launch overhead that a graph replay mostly removes.

How: the prompt's N flat rows (hidden `[N, h]`, slots `[N]`, positions `[N]`) are copied into
the buffers of N's bucket (`token_bucket`: the next multiple of 64 up to 1,024 tokens, of 256
above), viewed as `[pad / 64, 64]` dense rows, and written by DFLASH's own prefix-valid path
(`cache_loc_2d`, `commit_lens`), the one its decode steps use: row r commits min(64, max(0,
N - 64 r)) tokens, computed on the device from N inside the graph, so a padded token is never
written. Each token gets the same work as in the flat path (its projection, norm, RoPE by its
own position, its slot). Prompts longer than the last bucket, and everything without graphs,
take DFLASH's flat path. The drafter's K/V only shape the drafts, which the target verifies,
so outputs stay the target's whatever the append writes.

Measured (H100, SGLang 0.5.16, the fixture, 2026-12-06 night; BENCHMARKS.md "Host cuts"):
`check` inside the server found the drafter K/V of every checked prompt equal to DFLASH's
(largest difference 0); with `DFLASH_FAST_DECODE_PREP` the adaptive servers made 14-29 % more
at 16, 32 and 64 requests than with neither (two servers each way); greedy outputs unchanged.

`DFLASH_PREFILL_APPEND`: 1 (default: the graphs), 0 (DFLASH's eager append), check (both, and
the drafter K/V they wrote compared at the prompt's slots: `check_kv`, raises on a mismatch).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

from ..errors import env_choice
from .sglang_buckets import BucketGraphs
from .sglang_tree_append import drafter_input

logger = logging.getLogger(__name__)

ENV = "DFLASH_PREFILL_APPEND"
MODES = ("0", "1", "check")
WIDTH = 64  # tokens per dense row of the prefix-valid write
MAX_TOKENS = 2048  # the last bucket: 20 graphs (the dev prompts are 362 tokens on average)


def mode(environ=os.environ) -> str:
    """`DFLASH_PREFILL_APPEND`: 1 (default), 0 or check; a `ConfigError` otherwise."""
    return env_choice(environ, ENV, "1", MODES, "the prompt's drafter-KV append through CUDA "
                      "graphs; check: both, compared")


def token_bucket(n: int) -> int:
    """The padded token count of a prompt of `n` tokens: a multiple of 64 up to 1,024, then of
    256 (at most 255 padded tokens, against a prefill of over 1,024)."""
    if n < 1:
        raise ValueError(f"prefill token count must be >= 1, got {n}")
    step = WIDTH if n <= 1024 else 4 * WIDTH
    return -(-n // step) * step


def prefill_buckets(max_tokens: int) -> list[int]:
    """Every bucket up to the one holding `max_tokens`, ascending."""
    top = token_bucket(max_tokens)
    return [b for b in range(WIDTH, top + 1, WIDTH) if token_bucket(b) == b]


class PrefillAppend:
    """`run(hid, loc, pos)` (a prompt's flat rows) calls `append_fn(**kwargs)` (DFLASH's append
    keywords, 2-D slots and commit lengths) over the prompt's token bucket; `keep()` as
    `BucketGraphs`'s (DFLASH's fused-KV workspaces)."""

    def __init__(self, device: torch.device, append_fn: Callable[..., None],
                 max_tokens: int = MAX_TOKENS, graphs: bool = True,
                 keep: Callable[[], Sequence[torch.Tensor]] | None = None):
        self.device, self.append_fn = device, append_fn
        self.max_tokens = token_bucket(max_tokens)
        self.graphs = BucketGraphs(device, "prefill append", graphs, keep, token_bucket)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)  # [1] N of this call
        self.starts = torch.arange(0, self.max_tokens, WIDTH, device=device)  # [rows] row starts
        self.checked, self.worst = 0, 0.0  # `append_prompt`'s checks and largest difference

    def fits(self, n: int) -> bool:
        return 1 <= n <= self.max_tokens

    def warm(self, hidden_size: int, dtype: torch.dtype) -> list[int]:
        """Capture every bucket now, the largest first (DFLASH's workspaces grow once), with a
        count of 0 (nothing is written); returns the buckets captured ([] without graphs)."""
        if not self.graphs.enabled:
            return []
        sizes = prefill_buckets(self.max_tokens)
        self.graphs.reserve(sizes[-1])  # one set of input buffers for every bucket
        for pad in reversed(sizes):
            z = torch.zeros(pad, dtype=torch.int64, device=self.device)
            self.run(torch.zeros(pad, hidden_size, dtype=dtype, device=self.device), z, z, n=0)
        return sizes if self.graphs.enabled else []

    def run(self, hid: torch.Tensor,  # [N, h] the prompt tokens' target hidden states
            loc: torch.Tensor,  # [N] their drafter-KV slots
            pos: torch.Tensor,  # [N] their positions
            n: int | None = None,  # tokens to write (default N; 0: none, for the warm-up)
            ) -> None:
        pad, (h, lo, po) = self.graphs.load((hid, loc, pos))
        self.count.fill_(int(hid.shape[0]) if n is None else n)
        rows = pad // WIDTH

        def phase() -> None:
            commit = (self.count - self.starts[:rows]).clamp_(0, WIDTH).to(torch.int32)  # [rows]
            self.append_fn(target_hidden=h, cache_loc=lo, positions=po,
                           cache_loc_2d=lo.view(rows, WIDTH), commit_lens=commit)

        self.graphs.run(pad, phase)


def drafter_kv(pool, layer_ids: Sequence[int], loc: torch.Tensor) -> list[torch.Tensor]:
    """The drafter's K and V rows at `loc` of every layer (a KV pool with `get_key_buffer` /
    `get_value_buffer`, as SGLang's), copied: `[2 * layers]` tensors `[N, heads, dim]`."""
    idx = loc.to(torch.int64)
    return [buf(i)[idx].clone() for i in layer_ids
            for buf in (pool.get_key_buffer, pool.get_value_buffer)]


def check_kv(reference: list[torch.Tensor], ours: list[torch.Tensor], tol: float = 0.02) -> float:
    """The largest difference between two `drafter_kv` reads; a `RuntimeError` above `tol` (+
    `tol` relative; bf16 projections of a padded and an unpadded batch may round apart)."""
    worst = 0.0
    for a, b in zip(reference, ours, strict=True):
        d = (a.float() - b.float()).abs()
        worst = max(worst, float(d.max()) if d.numel() else 0.0)
        if bool((d > tol + tol * a.float().abs()).any()):
            raise RuntimeError(f"{ENV}=check: the graphed prefill append wrote drafter K/V "
                               f"that differ from DFLASH's by up to {worst:.4g} (> {tol})")
    return worst


def stage_for(worker, append_fn: Callable[..., None],
              keep: Callable[[], Sequence[torch.Tensor]] | None) -> PrefillAppend | None:
    """A warmed `PrefillAppend` for a DFLASH worker (the drafter's `fc` width and dtype; the
    last bucket at most the server's chunked-prefill size); None when the drafter input is
    unknown or graphs could not be captured (DFLASH's flat path stays)."""
    known = drafter_input(worker)
    if known is None:
        return None
    chunk = int(getattr(worker.server_args, "chunked_prefill_size", 0) or 0)
    stage = PrefillAppend(torch.device(worker.device), append_fn,
                          min(MAX_TOKENS, chunk) if chunk > 0 else MAX_TOKENS, True, keep)
    return stage if stage.warm(*known[1:]) else None


def append_prompt(stage: PrefillAppend, eager: Callable[..., None], check=None, *,
                  target_hidden: torch.Tensor, cache_loc: torch.Tensor,
                  positions: torch.Tensor) -> None:
    """The prompt's drafter-KV append through `stage`. With `check` = (KV pool, drafter layer
    ids): DFLASH's flat append (`eager`) first, its K/V read, the slots zeroed, then the stage,
    and the two compared (`check_kv`; the largest difference so far logged at the 1st, 2nd,
    4th, ... check)."""
    if check is None:
        stage.run(target_hidden, cache_loc, positions)
        return
    pool, layer_ids = check
    eager(target_hidden=target_hidden, cache_loc=cache_loc, positions=positions)
    reference = drafter_kv(pool, layer_ids, cache_loc)
    idx = cache_loc.to(torch.int64)
    for i in layer_ids:
        pool.get_key_buffer(i)[idx] = 0
        pool.get_value_buffer(i)[idx] = 0
    stage.run(target_hidden, cache_loc, positions)
    stage.worst = max(stage.worst, check_kv(reference, drafter_kv(pool, layer_ids, cache_loc)))
    stage.checked += 1
    if stage.checked & (stage.checked - 1) == 0:
        logger.warning("%s=check: %d prompts' drafter K/V equal DFLASH's (largest difference "
                       "%.4g)", ENV, stage.checked, stage.worst)
