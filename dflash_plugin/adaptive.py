"""Adaptive speculation: pick the block length that maximises expected tokens per second.

A round of block length q drafts q - 1 tokens and verifies q; it commits 1 + (accepted drafts)
tokens. With *survival* s_k = P(accepted length >= k) (the per-position acceptance the metrics
report), a round of length q commits E(q) = 1 + s_1 + ... + s_{q-1} tokens on average and costs
T(q) (verify + draft, measured); q = 1 is plain decoding (E = 1, no drafter). The policy takes
the q of the largest E(q) / T(q), so it picks plain decoding whenever speculation does not pay.
Survival is tracked with exponential decay, so it follows a request's (or batch's) recent rounds.
`AdaptiveConfig` + `BlockPolicy` drive the fast runtime's loop (`fast.loop.fast_generate`, its
adaptive part in `fast.adaptive_loop`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from .errors import require


def expected_tokens(survival: list[float], q: int) -> float:
    """E(q) = 1 + s_1 + ... + s_{q-1}; positions past the measured ones count as 0."""
    require(q >= 1, "block_size", f"must be >= 1, got {q}")
    return 1.0 + sum(survival[: q - 1])


def best_block(
    round_ms: dict[int, float],  # q -> measured milliseconds of one round (q = 1: plain step)
    survival: list[float],  # s_k for k = 1..
) -> int:
    """The block length of the largest expected tokens per millisecond (ties: the shorter)."""
    require(bool(round_ms), "round_ms", "needs at least one measured block length")
    bad = {q: t for q, t in round_ms.items() if q < 1 or not t > 0}
    require(not bad, "round_ms", f"block lengths >= 1 with positive times, got {bad}")
    return max(sorted(round_ms), key=lambda q: expected_tokens(survival, q) / round_ms[q])


def cap_plain(round_ms: dict[int, float], below: float = 0.95) -> dict[int, float]:
    """Round times with the plain step (q = 1) at most `below` x the cheapest speculative
    round's: a round of q > 1 verifies q tokens per row and runs the drafter besides, so it
    costs more than a plain step of the same batch, and a plain time above one is a bad sample
    (on the H200 at the Qwen3-8B shape, 2026-12-04, one interval read 44 ms for a plain step of
    64 requests against 13 ms in plain SGLang; the row then ran q = 8 at 0.53x plain and never
    timed plain again). Capped strictly below, plain wins while the drafts add under 5 %, so it
    runs, is timed again, and its true time replaces the bad one."""
    require(0 < below <= 1, "below", f"must be in (0, 1], got {below}")
    out = dict(round_ms)
    longer = [t for q, t in round_ms.items() if q > 1]
    if 1 in out and longer:
        out[1] = min(out[1], below * min(longer))
    return out


@dataclass
class Survival:
    """Decayed estimate of s_k from observed rounds (prior: `prior` at every position, with the
    weight of `prior_rounds` rounds, so a fresh estimate neither rules speculation out nor in)."""

    positions: int  # k = 1..positions
    decay: float = 0.9  # weight of the past per observed round
    prior: float = 0.5
    prior_rounds: float = 2.0
    hits: list[float] = field(default_factory=list)  # decayed rounds with accepted >= k
    seen: list[float] = field(default_factory=list)  # decayed rounds that drafted position k

    def __post_init__(self):
        require(self.positions >= 1, "positions", f"must be >= 1, got {self.positions}")
        require(0 < self.decay <= 1, "decay", f"must be in (0, 1], got {self.decay}")
        require(0 <= self.prior <= 1, "prior", f"must be in [0, 1], got {self.prior}")
        self.hits = [self.prior * self.prior_rounds] * self.positions
        self.seen = [self.prior_rounds] * self.positions

    def observe(self, drafted: int, accepted: int) -> None:
        """One round of one row that drafted positions 1..drafted and accepted the first
        `accepted` (`observe_round` with one row)."""
        self.observe_round(drafted, [accepted])

    def observe_round(self, drafted: int, accepted: list[int]) -> None:
        """One round of a batch, its rows pooled: every row drafted positions 1..drafted and row
        i accepted `accepted[i]`. A round weighs one, whatever the batch (the fraction of its
        rows past each position), so the prior keeps its weight of `prior_rounds` rounds at any
        batch size; decays once per round."""
        g, n = min(drafted, self.positions), len(accepted)
        if not n:
            return
        at = [0] * (g + 1)  # rows by accepted length (capped at g)
        for a in accepted:
            at[min(a, g)] += 1
        above = n
        for k in range(g):
            above -= at[k]  # rows with accepted > k
            self.hits[k] = self.hits[k] * self.decay + above / n
            self.seen[k] = self.seen[k] * self.decay + 1.0

    def values(self) -> list[float]:  # s_k, made non-increasing (a survival function)
        out, cap = [], 1.0
        for h, n in zip(self.hits, self.seen):
            cap = min(cap, h / n)
            out.append(cap)
        return out


@dataclass(frozen=True)
class AdaptiveConfig:
    """How `fast_generate(..., adaptive=AdaptiveConfig(...))` picks each round's block length.

    round_ms: q -> ms of one round at the decoder's batch (None: the decoder's own, measured by
    `fast.adaptive_loop.measure_round_ms` after `warmup()`); the policy picks among these q (<=
    the call's block_size). reads_every: most rounds issued at q > 1 before the next host read
    (and update; 2 after the first choice, which rests on the prior alone).
    probe_every: after at least this many rounds shorter than the longest measured q (plain
    rounds included), one round at that longest q, so a batch whose drafts started to pass, or
    pass further than the rounds verify, is noticed (0: never); probes come further apart when
    needed to cost at most probe_overhead of those rounds' time. probe_backoff: each probe
    after which the choice stays where it was doubles the spacing of the next, up to
    2 ** probe_backoff times (0: fixed spacing); a change of the choice restores it.
    plain_context: plain rounds also write the drafter's context (default; False: a plain round
    costs a plain step, but drafts after a plain stretch see stale context there, so probes
    accept less and the policy can stay plain where speculation pays: measured on the H200,
    batch 1 stuck at q = 1 for 430 of 680 rounds, 0.79x of fixed DFlash).
    forced: a fixed q, or a function of the decision index (0, 1, ...) -> q
    (tests)."""

    round_ms: dict[int, float] | None = None
    decay: float = 0.95
    prior: float = 0.5
    reads_every: int = 16
    probe_every: int = 16
    probe_overhead: float = 0.05
    probe_backoff: int = 0
    plain_context: bool = True
    forced: int | Callable[[int], int] | None = None

    def __post_init__(self):
        if self.round_ms is not None:
            bad = {q: t for q, t in self.round_ms.items() if q < 1 or not t > 0}
            require(bool(self.round_ms) and not bad, "round_ms",
                    f"block lengths >= 1 with positive times, got {self.round_ms}")
        require(self.reads_every >= 1, "reads_every", f"must be >= 1, got {self.reads_every}")
        require(self.probe_every >= 0, "probe_every", f"must be >= 0, got {self.probe_every}")
        require(0 < self.probe_overhead <= 1, "probe_overhead",
                f"must be in (0, 1], got {self.probe_overhead}")
        require(0 <= self.probe_backoff <= 16, "probe_backoff",
                f"must be in [0, 16], got {self.probe_backoff}")
        require(self.forced is None or callable(self.forced) or (
            isinstance(self.forced, int) and self.forced >= 1), "forced",
            f"a block length >= 1 or a function of the decision index, got {self.forced!r}")
        Survival(1, self.decay, self.prior)  # checks decay and prior


class BlockPolicy:
    """One batch's block-length choice over a generation: pooled decayed survival of the live
    rows, `best_block` over the measured round times, plain-round probes; the loop calls
    `observe_round` for every round it reads back and `choose` at every host read."""

    def __init__(self, cfg: AdaptiveConfig, round_ms: dict[int, float], max_q: int,
                 positions: int):
        self.cfg = cfg
        self.round_ms = {q: t for q, t in round_ms.items() if q <= max_q}
        require(bool(self.round_ms) or cfg.forced is not None, "round_ms",
                f"no measured block length <= block_size {max_q}: got {sorted(round_ms)}")
        self.max_q = max_q
        self.survival = Survival(positions, cfg.decay, cfg.prior)
        self.decisions = 0
        self.probe_len = 1  # rounds per probe (ServerPolicy: 2, see StepClock)
        self.short_rounds = 0  # rounds since the last one at probe_q (plain ones included)
        self.quiet = 0  # probes since the choice last moved (spacing x 2 ** quiet)
        self.untimed: set[int] = set()  # q whose time is only given (ServerPolicy: the tune's)
        self._last_q = None  # the choice at the previous decision
        longer = [q for q in self.round_ms if q > 1]
        self.probe_q = max(longer) if len(self.round_ms) > 1 and longer else None

    def spacing(self, q: int) -> int:
        """Rounds at q between probes at probe_q: probe_every, or more where a probe (of
        `probe_len` rounds) costs over probe_overhead of those rounds' time (0: never); times
        2 ** quiet (`probe_backoff`). While probe_q's time is `untimed` (given, e.g. by a tune
        report from another machine): probe_every. A given time too long for probe_q kept the
        policy off speculation for hundreds of rounds (SGLang, fixture, 64 requests, H100,
        2026-12-06: q = 16 given 9.39 ms, 3.07 live; 256-506 plain steps before a probe)."""
        if not self.cfg.probe_every or not self.probe_q or q >= self.probe_q:
            return 0
        if self.probe_q in self.untimed:
            return self.cfg.probe_every
        extra = self.probe_len * (self.round_ms[self.probe_q] / self.round_ms[q] - 1)
        base = max(self.cfg.probe_every, math.ceil(extra / self.cfg.probe_overhead))
        return base << self.quiet

    def observe_round(self, drafted: int, accepted: list[int]) -> None:
        self.survival.observe_round(drafted, accepted)
        long = self.probe_q is not None and drafted + 1 >= self.probe_q
        self.short_rounds = 0 if long else self.short_rounds + 1

    def choose(self) -> tuple[int, int]:
        """(q, the most rounds to issue at q before the next read)."""
        i, self.decisions = self.decisions, self.decisions + 1
        f = self.cfg.forced
        if f is not None:
            q = f(i) if callable(f) else f
            require(isinstance(q, int) and 1 <= q <= self.max_q, "forced",
                    f"block length in [1, {self.max_q}] (block_size), got {q!r}")
            return q, self.cfg.reads_every
        q = best_block(self.round_ms, self.survival.values())
        if q != self._last_q:  # the choice moved: probes at their base spacing again
            self.quiet, self._last_q = 0, q
        every = self.spacing(q)  # a shorter q leaves the longer drafts unobserved: probe them
        if every and self.short_rounds >= every:
            self.quiet = min(self.quiet + 1, self.cfg.probe_backoff)  # undone if q moves
            return self.probe_q, 1
        most = self.cfg.reads_every if q > 1 else 1 << 30
        if i == 0 and q > 1:  # the first choice rests on the prior alone: read back soon
            most = min(2, most)
        return q, min(most, every - self.short_rounds) if every else most


def nearest_row(rows: list[int], bs: int) -> int:
    """The measured concurrency nearest to batch size `bs` in log scale (ties: the smaller)."""
    require(bool(rows), "rows", "needs at least one measured concurrency")
    require(bs >= 1, "batch_size", f"must be >= 1, got {bs}")
    # the ratio max/min as an exact fraction: log-scale ties stay ties (floats broke some)
    return min(sorted(rows), key=lambda c: (Fraction(max(c, bs), min(c, bs)), c))


class StepClock:
    """Step times of a serving engine from its decode-step launch times alone. In an overlapped
    schedule (SGLang's default: launch step N, then wait for step N - 1's results) the time
    from launch N to launch N + 1 is mostly step N - 1's, where the GPU sets the pace, and
    step N's launch work, where the host does; without overlap it is step N's. So an interval
    counts only where steps N - 1 and N had the same batch size and q (and step N + 1 the same
    batch size): then it is a step of that (bs, q) either way. (Attributed to step N alone, a
    lone q = 16 probe among plain steps read as a plain step and the plain step after it as
    the probe: on the H200 at the Qwen3-8B shape the server believed 5.56 ms for q = 16 at 64
    requests against 6.7 for q = 1 and ran at 0.36x plain, 2026-12-03.) Probes therefore take
    two steps (`ServerPolicy(probe_steps=2)`). A prefill or idle step in between: `reset`."""

    def __init__(self):
        self._prev = self._last = None  # (launch s, bs, q) of steps N - 1 and N

    def reset(self) -> None:
        self._prev = self._last = None

    def launch(self, now: float, bs: int, q: int) -> tuple[int, int, float] | None:
        """Step N + 1 of `bs` rows at q launches at `now` (seconds): the (bs, q, ms) sample
        of the interval since step N's launch, when it counts (see the class), else None."""
        prev, last = self._prev, self._last
        self._prev, self._last = last, (now, bs, q)
        if prev is None or last is None or prev[1:] != last[1:] or last[1] != bs:
            return None
        return last[1], last[2], 1e3 * (now - last[0])


class LaunchLedger:
    """Where a serving engine's wall time goes between its batch launches, by the kinds of the
    two launches around each interval: 'dd' (decode to decode: the steady step), 'dp' (a
    decode followed by a prefill launch) and 'p.' (a prefill launch to the next launch of any
    kind); with the requests the prefill passes admitted. The intervals next to a prefill,
    against 'dd', give what each admission pass costs the server's decode (in an overlapped
    schedule an interval holds the previous step's GPU time and this launch's host work, so
    the kinds are charged approximately). Idle gaps over `gap_s` (no batch to run) are left
    out. Every decode launch's requests are counted too: their mean says whether the decode
    batches run full between admissions; `rate` is the recent requests admitted per decode
    launch (decayed by `decay` a launch), the arrival rate at a steady load."""

    def __init__(self, gap_s: float = 0.05, decay: float = 0.98):
        self.gap_s, self.decay = gap_s, decay
        self.rate, self._since = 0.0, 0  # admissions per decode launch; since the last one
        self._last: tuple[float, str, int] | None = None  # (launch s, 'd' or 'p', requests)
        self.n = {"dd": 0, "dp": 0, "p.": 0}
        self.s = {"dd": 0.0, "dp": 0.0, "p.": 0.0}
        self.admitted = 0  # requests in the prefill passes
        self.decodes = [0, 0]  # decode launches, their requests

    def launch(self, now: float, kind: str, requests: int = 0) -> None:
        """A launch of `kind` ('d' decode, 'p' prefill of `requests` requests) at `now` (s)."""
        require(kind in ("d", "p"), "kind", f"must be 'd' or 'p', got {kind!r}")
        if kind == "d":
            self.decodes[0] += 1
            self.decodes[1] += requests
            self.rate = self.decay * self.rate + (1 - self.decay) * self._since
        self._since = 0 if kind == "d" else self._since + requests
        if self._last is not None and 0 <= now - self._last[0] <= self.gap_s:
            key = "p." if self._last[1] == "p" else "d" + kind
            self.n[key] += 1
            self.s[key] += now - self._last[0]
            self.admitted += self._last[2]  # 0 after a decode
        self._last = (now, kind, requests if kind == "p" else 0)

    def mean_ms(self, kind: str) -> float | None:
        """The mean ms of `kind`'s intervals ('dd', 'dp' or 'p.'); None before the first."""
        return 1e3 * self.s[kind] / self.n[kind] if self.n[kind] else None

    def summary(self) -> dict:
        """Per kind the intervals and their mean ms, the share of the counted wall time, the
        mean requests per prefill pass and per decode launch, the sums behind them and the
        recent admissions per decode launch."""
        total = sum(self.s.values())
        out = {k: {"n": self.n[k], "ms": round(self.mean_ms(k), 2) if self.n[k] else None,
                   "share": round(self.s[k] / total, 3) if total else None} for k in self.n}
        passes = self.n["p."]
        out["per_prefill"] = round(self.admitted / passes, 2) if passes else None
        launches, rows = self.decodes
        out["per_decode"] = round(rows / launches, 2) if launches else None
        # the sums too, so two summaries give the interval between them exactly
        out["sums"] = {"decodes": launches, "rows": rows, "admitted": self.admitted}
        out["rate"] = round(self.rate, 3)
        return out


class ServerPolicy:
    """A serving engine's block length per step (SGLang's DFLASH_ADAPTIVE): round times measured
    per concurrency (`engines.sglang_adaptive.step_times`), one pooled decayed survival of every
    round the server verified, and one `BlockPolicy` per measured concurrency (its probes); a
    step of batch size bs is decided by the row of the nearest measured concurrency
    (`nearest_row`). The given times are replaced by the server's own as it measures them
    (`timed`): a step inside the speculative engine costs what it costs there, not what another
    engine mode measured. The engine reads accepted lengths back late (SGLang: one step behind),
    so `observe` takes the q the step was issued with."""

    def __init__(self, cfg: AdaptiveConfig, rows: dict[int, dict[int, float]], max_q: int,
                 probe_steps: int = 1):
        require(bool(rows), "rows", "needs round times of at least one concurrency")
        require(max_q >= 1, "max_q", f"must be >= 1, got {max_q}")
        require(probe_steps >= 1, "probe_steps", f"must be >= 1, got {probe_steps}")
        self.probe_steps = probe_steps  # consecutive steps per probe (2: StepClock times one)
        self._probing: dict[int, int] = {}  # row -> probe steps still to issue
        positions = max(max_q - 1, 1)
        self.survival = Survival(positions, cfg.decay, cfg.prior)
        self.policies = {}
        self._raw: dict[int, dict[int, float]] = {}
        for c, ms in sorted(rows.items()):
            p = BlockPolicy(cfg, ms, max_q, positions)
            p.survival = self.survival  # acceptance does not depend on the batch size
            p.probe_len = probe_steps
            self._raw[c] = dict(p.round_ms)  # q -> ms given or measured, before `cap_plain`
            p.untimed = set(p.round_ms)  # given times, until `timed` measures them live
            p.round_ms = cap_plain(p.round_ms)
            self.policies[c] = p
        self._live: dict[tuple[int, int], tuple[float, float]] = {}  # (c, q) -> decayed w, sum
        self._warm: set[tuple[int, int]] = set()  # (bs, q) whose first step time was seen
        self._rows: dict[int, int] = {}  # batch size -> its row (looked up every step)

    def _row(self, bs: int) -> int:
        if bs not in self._rows:
            self._rows[bs] = nearest_row(list(self.policies), bs)
        return self._rows[bs]

    def blocks(self) -> list[int]:
        """Every q a step can take (the runtime states to build)."""
        return sorted({q for p in self.policies.values() for q in p.round_ms})

    def choose(self, bs: int) -> int:
        c = self._row(bs)
        p = self.policies[c]
        if self._probing.get(c):  # the rest of a probe
            self._probing[c] -= 1
            return p.probe_q
        q, most = p.choose()
        if most == 1 and q == p.probe_q:
            p.short_rounds = 0  # a probe: its rounds are read back late, do not repeat it
            self._probing[c] = self.probe_steps - 1
        return q

    def observe(self, bs: int, q: int, accepted: list[int]) -> None:
        """One verified step of `bs` rows issued at block length q (q - 1 drafted each)."""
        self.policies[self._row(bs)].observe_round(q - 1, accepted)

    def timed(self, bs: int, q: int, ms: float) -> None:
        """A step time measured live (ms) of a step of `bs` rows at q: from the second one on
        (the first step of a batch size at a q may compile kernels or grow buffers: 858 ms on
        the H200, which kept q = 1 unchosen for the server's life) it replaces the given time
        of that row and q, as a decayed mean (`decay` 0.9 per sample; a sample over 4x the
        current mean, e.g. a pause of the host, is left out). The row decides by these times
        with the plain step capped at its cheapest speculative round (`cap_plain`): a plain
        time read too high is never re-measured, as plain is then never chosen there. Until a
        row's probe length is timed live, the row probes every `probe_every` steps."""
        if not ms > 0:
            return
        c = self._row(bs)
        p, key = self.policies[c], (c, q)
        if q not in p.round_ms:
            return
        if (bs, q) not in self._warm:
            self._warm.add((bs, q))
            return
        w, tot = self._live.get(key, (0.0, 0.0))
        if w and ms > 4 * tot / w:
            return
        w, tot = 0.9 * w + 1.0, 0.9 * tot + ms
        self._live[key] = (w, tot)
        self._raw[c][q] = tot / w
        p.untimed.discard(q)
        p.round_ms = cap_plain(self._raw[c])  # `choose` and the probe spacing read it

    def times(self) -> dict[int, dict[int, float]]:
        """concurrency -> {q: ms} the policy decides by now (measured live where it could)."""
        return {c: dict(sorted(p.round_ms.items())) for c, p in self.policies.items()}
