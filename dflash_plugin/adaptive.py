"""Adaptive speculation: pick the block length that maximises expected tokens per second.

A round of block length q drafts q - 1 tokens and verifies q; it commits 1 + (accepted drafts)
tokens. With *survival* s_k = P(accepted length >= k) (the per-position acceptance the metrics
report), a round of length q commits E(q) = 1 + s_1 + ... + s_{q-1} tokens on average and costs
T(q) (verify + draft, measured); q = 1 is plain decoding (E = 1, no drafter). The policy takes
the q of the largest E(q) / T(q), so it picks plain decoding whenever speculation does not pay.
Survival is tracked with exponential decay, so it follows a request's (or batch's) recent rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        """One round that drafted positions 1..drafted and accepted the first `accepted`."""
        for k in range(min(drafted, self.positions)):
            self.hits[k] = self.hits[k] * self.decay + (1.0 if k < accepted else 0.0)
            self.seen[k] = self.seen[k] * self.decay + 1.0

    def values(self) -> list[float]:  # s_k, made non-increasing (a survival function)
        out, cap = [], 1.0
        for h, n in zip(self.hits, self.seen):
            cap = min(cap, h / n)
            out.append(cap)
        return out
