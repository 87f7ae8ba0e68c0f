"""Adaptive speculation in the fast runtime: the round costs the policy weighs and its part of
`loop.fast_generate(..., adaptive=...)`.

`measure_round_ms` times one round per block length q on a warmed-up decoder (q > 1: draft a
full block, verify q; q = 1: a plain step). `AdaptiveRounds` is the adaptive path of one
generation: it builds the `adaptive.BlockPolicy` (one decayed survival estimate pooled over
the batch's live rows, `best_block` over the measured q <= block_size, probes after plain
stretches), feeds it the rounds read back at each host read (one read: the state's done /
out_len plus those rounds' history rows), and says how each round runs: every q > 1 round drafts
the policy's longest block and verifies its first q - 1 drafts; a q = 1 round is a plain step (no
draft) that writes the drafter's context only with `plain_context`. Switching q costs
no capture (`FastDecoder.warmup` has captured every q). `dec` is a `loop.FastDecoder`; this
module imports nothing of `loop` (no cycle), which imports it when a generation is adaptive.
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch

from ..adaptive import AdaptiveConfig, BlockPolicy
from ..errors import require
from .graphs import _event, _sync

CANDIDATES = (1, 2, 4, 8, 16)  # block lengths `measure_round_ms` times by default


@torch.inference_mode()
def measure_round_ms(dec, candidates=None, *, reps: int = 5, rounds: int = 4,
                     context: int | None = None, plain_context: bool = True,
                     drafted: int | None = None) -> dict[int, float]:
    """Milliseconds of one round at each block length q in `candidates` (default `CANDIDATES`
    up to max_block) for the decoder's whole batch, at a context of `context` tokens (default:
    half the cache): per q, a prefill, two untimed rounds, then the median over `reps` runs of
    `rounds` back-to-back rounds (CUDA events; the host clock elsewhere). q > 1 rounds draft a
    block of `drafted` (default max_block, as the adaptive loop does) and verify q; q = 1 is a
    plain step (with the drafter's context write when `plain_context`, as
    `AdaptiveConfig.plain_context` runs it).
    Call after `warmup()` (else the first rounds capture graphs); outputs are unchanged (every
    generation starts with a prefill, which resets all state). Stored in `dec.round_ms`."""
    if candidates is None:
        candidates = [q for q in CANDIDATES if q <= dec.max_block]
    cands = sorted(set(candidates))
    bad = [q for q in cands if not isinstance(q, int) or not 1 <= q <= dec.max_block]
    require(bool(cands) and not bad, "candidates",
            f"block lengths in [1, {dec.max_block}] (max_block), got {list(candidates)}")
    require(dec.drafter is not None or cands == [1], "candidates",
            f"block lengths > 1 need a drafter; this decoder has none (got {cands})")
    require(reps >= 1 and rounds >= 1, "reps", f"reps and rounds must be >= 1, got {reps}, "
            f"{rounds}")
    top = dec.max_len - dec.max_block - 1
    width = min(max(1, (dec.max_len - dec.max_block) // 2 if context is None else context), top)
    out = {}
    for q in cands:
        dec.prefill([[0] * width] * dec.batch, dec.max_len - dec.max_block - width)
        ctx = q > 1 or plain_context
        dl = drafted or dec.max_block
        for _ in range(2):
            dec.round(q, ctx=ctx, drafted=dl)
        spans = []
        for _ in range(reps):
            a, b = _event(dec.device), _event(dec.device)
            a.record()
            for _ in range(rounds):
                dec.round(q, ctx=ctx, drafted=dl)
            b.record()
            spans.append((a, b))
        _sync(dec.device)
        out[q] = statistics.median(a.elapsed_time(b) for a, b in spans) / rounds
    dec.round_ms = out
    return out


def _policy(dec, adaptive, proposer, block_size) -> BlockPolicy:
    cfg = AdaptiveConfig() if adaptive is True else adaptive
    require(isinstance(cfg, AdaptiveConfig), "adaptive",
            f"True or an AdaptiveConfig, got {adaptive!r}")
    require(proposer == "dflash" and dec.drafter is not None, "adaptive",
            f"needs the DFlash proposer and a decoder with a drafter (proposer={proposer!r}, "
            f"drafter {'loaded' if dec.drafter is not None else 'none'})")
    round_ms = cfg.round_ms if cfg.round_ms is not None else dec.round_ms
    require(bool(round_ms) or cfg.forced is not None, "round_ms",
            "no round times: call fast.adaptive_loop.measure_round_ms(dec) after warmup(), or "
            "pass AdaptiveConfig(round_ms={q: ms})")
    return BlockPolicy(cfg, round_ms, block_size, dec.max_block - 1)


class AdaptiveRounds:
    """The adaptive path of one `fast_generate` call over `dec` with `block_size` (the policy's
    longest block: the drafter's block in every adaptive round)."""

    def __init__(self, dec, adaptive: AdaptiveConfig | bool, proposer: str,
                 block_size: int):
        self.dec = dec
        self.policy = _policy(dec, adaptive, proposer, block_size)
        self.top = block_size
        self.seen = 0  # rounds the policy has observed

    def read(self, issued: list[int]) -> tuple[list[int], list[int]]:
        """The loop's host read, (done, out_len) per row, plus the rounds recorded since the
        last read (all of one g, `issued`: g of every issued round), observed by the policy;
        their history rows are read only when those rounds drafted."""
        dec, b, seen = self.dec, self.dec.batch, self.seen
        drafted = len(issued) > seen and issued[-1] > 0
        flat = torch.cat([dec.done.long(), dec.out_len, dec.round_idx, dec.history[
            seen:len(issued) if drafted else seen].flatten()]).tolist()
        done, out_len, recorded = flat[:b], flat[b:2 * b], flat[2 * b]
        for r in range(recorded - seen):
            at = 2 * b + 1 + r * 3 * b
            acc, live_r = flat[at + b:at + 2 * b], flat[at + 2 * b:at + 3 * b]
            self.policy.observe_round(issued[seen + r], [a for a, v in zip(acc, live_r) if v])
        self.seen = recorded
        return done, out_len

    def round_args(self, g: int) -> dict:
        """`FastDecoder.round` keywords of a round of g drafts: the full block drafted, and the
        drafter's context skipped in plain rounds unless `plain_context`."""
        return dict(ctx=g > 0 or self.policy.cfg.plain_context, drafted=self.top)

    @staticmethod
    def block_lengths(issued: list[int]) -> dict[int, int]:
        """Rounds per block length (`metrics.block_lengths`) of the recorded rounds' g."""
        return dict(sorted(Counter(g + 1 for g in issued).items()))
