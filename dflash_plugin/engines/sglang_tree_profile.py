"""Where a DFLASH_TREE decode round's time goes, inside SGLang (no SGLang import here).

`DFLASH_TREE_PROFILE=N` (environment of the server): every N decode rounds the worker logs one
line with the mean milliseconds of each phase of those rounds on the GPU's timeline (CUDA
events on the forward stream, so a phase's time includes the GPU's idle gaps while the host
launches it): draft (the drafter's block forward), tree (top-K over the LM head, the tree build,
SGLang's verify input), verify (`run_eagle_verify`: target forward, acceptance, tree-path
compaction), append (the drafter's KV of the accepted path, the next draft input); and, apart
from the round's sum, "between": from the previous round's end to this round's start (the
scheduler's work between rounds that the GPU waits for, plus any prefill run in between; the
H200's fixture rows had 4.7 ms rounds on this timeline but 7.0 ms of wall time per round,
2026-12-02). The same line gives each phase's host time (the Python that launches it, from
`time.perf_counter`): a phase whose host time exceeds its GPU time keeps the GPU waiting when
the scheduler overlaps rounds. Unset or 0:
off (no events, no syncs). A log line costs one device sync; profile only to measure.
"""

from __future__ import annotations

import logging
import os
import time

from ..errors import ConfigError
from ..fast.graphs import _event, _sync

logger = logging.getLogger(__name__)

ENV = "DFLASH_TREE_PROFILE"
PHASES = ("draft", "tree", "verify", "append")


def profile_every(environ=os.environ) -> int:
    """Rounds per profile line from `DFLASH_TREE_PROFILE` (0: off); a clear error otherwise."""
    raw = environ.get(ENV, "0").strip() or "0"
    if not raw.isdigit():
        raise ConfigError(ENV, f"must be an integer >= 0 (decode rounds per log line; 0 = off), "
                               f"got {raw!r}")
    return int(raw)


class RoundProfile:
    """Events of the rounds since the last line: `start()` at a round's start (None when off),
    `mark(ev, i)` after phase i of `PHASES`, `end(ev, batch)` when the round is issued."""

    def __init__(self, every: int, device, log=logger.info):
        self.every, self.device, self.log = every, device, log
        self.pending: list[list] = []  # per round: len(PHASES) + 1 events
        self.host: list[list[float]] = []  # per round: len(PHASES) + 1 perf_counter times
        self.gaps: list[tuple] = []  # (previous round's end, this round's start) events
        self.last_end = None
        self.lines: list[dict[str, float]] = []  # every logged line's means (tests, debugging)

    def start(self):
        if not self.every:
            return None
        ev = [_event(self.device) for _ in range(len(PHASES) + 1)]
        ev.append([0.0] * (len(PHASES) + 1))  # the host times, last
        ev[0].record()
        ev[-1][0] = time.perf_counter()
        return ev

    @staticmethod
    def mark(ev, phase: int) -> None:
        if ev is not None:
            ev[phase + 1].record()
            ev[-1][phase + 1] = time.perf_counter()

    def end(self, ev, batch: int) -> None:
        if ev is None:
            return
        self.host.append(ev.pop())
        self.pending.append(ev)
        if self.last_end is not None:
            self.gaps.append((self.last_end, ev[0]))
        self.last_end = ev[-1]
        if len(self.pending) >= self.every:
            self.flush(batch)

    def flush(self, batch: int) -> dict[str, float]:
        """Log the mean ms per phase of the pending rounds (one device sync) and reset."""
        if not self.pending:
            return {}
        _sync(self.device)
        n = len(self.pending)
        means = {p: sum(ev[i].elapsed_time(ev[i + 1]) for ev in self.pending) / n
                 for i, p in enumerate(PHASES)}
        round_ms = sum(means.values())
        gaps = [a.elapsed_time(b) for a, b in self.gaps]
        means["between"] = sum(gaps) / len(gaps) if gaps else float("nan")
        for i, p in enumerate(PHASES):
            means[f"host_{p}"] = sum(1e3 * (t[i + 1] - t[i]) for t in self.host) / n
        self.pending, self.gaps, self.host = [], [], []
        self.lines.append(means)
        self.log("DFLASH_TREE round profile (%d rounds, batch %d): %s; round %.3f ms; "
                 "between rounds %.3f ms; host %s", n, batch,
                 " ".join(f"{p} {means[p]:.3f}" for p in PHASES), round_ms, means["between"],
                 " ".join(f"{p} {means['host_' + p]:.3f}" for p in PHASES))
        return means
