"""Speculative-decoding metrics.

tau (acceptance length) = tokens committed per target verify forward, bonus included (prefill
excluded). Position k of a block (k = 1..g) is *drafted* in a round when g >= k and *accepted* when
the accepted length is >= k.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    prompt_tokens: int
    new_tokens: int = 0
    rounds: int = 0  # target verify forwards after prefill
    round_tokens: list[int] = field(default_factory=list)  # tokens committed per round
    drafted: list[int] = field(default_factory=list)  # per block position 1..B-1
    accepted: list[int] = field(default_factory=list)
    stop_reason: str = "length"  # "length" or "stop"

    @property
    def tau(self) -> float:
        return sum(self.round_tokens) / self.rounds if self.rounds else 0.0

    def record_round(self, committed: int, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.round_tokens.append(committed)
        grow = max(0, drafted - len(self.drafted))
        self.drafted += [0] * grow
        self.accepted += [0] * grow
        for k in range(drafted):
            self.drafted[k] += 1
            self.accepted[k] += int(k < accepted)


@dataclass
class AggregateMetrics:
    requests: list[RequestMetrics]
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    # tree drafting only: nodes_verified, build_seconds, accepted_depths {depth: rounds}
    tree: dict | None = None
    # adaptive speculation only: rounds per block length the policy issued {q: rounds}
    block_lengths: dict[int, int] | None = None

    @property
    def rounds(self) -> int:
        return sum(r.rounds for r in self.requests)

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.requests)

    @property
    def tau(self) -> float:
        committed = sum(sum(r.round_tokens) for r in self.requests)
        return committed / self.rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        width = max((len(r.drafted) for r in self.requests), default=0)
        out = []
        for k in range(width):
            d = sum(r.drafted[k] for r in self.requests if k < len(r.drafted))
            a = sum(r.accepted[k] for r in self.requests if k < len(r.accepted))
            out.append(a / d if d else 0.0)
        return out

    def to_dict(self) -> dict:
        return {
            "tau": self.tau,
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "drafted_tokens": sum(sum(r.drafted) for r in self.requests),
            "accepted_tokens": sum(sum(r.accepted) for r in self.requests),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "prefill_seconds": self.prefill_seconds,
            "total_seconds": self.total_seconds,
            **({"tree": {**self.tree, "nodes_per_round": self.tree["nodes_verified"] / self.rounds
                         if self.rounds else 0.0}} if self.tree is not None else {}),
            **({"block_lengths": self.block_lengths} if self.block_lengths is not None else {}),
            "tokens_per_second": self.new_tokens / self.total_seconds if self.total_seconds else 0,
            "requests": [
                {"prompt_tokens": r.prompt_tokens, "new_tokens": r.new_tokens, "tau": r.tau,
                 "rounds": r.rounds, "stop_reason": r.stop_reason} for r in self.requests
            ],
        }


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per request (prompt excluded, stop token included)
    metrics: AggregateMetrics
