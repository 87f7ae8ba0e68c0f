"""Decoding parameters of the block-diffusion runtime.

A denoising *step* unmasks some masked positions of the current block: `steps_per_token` style
(vanilla: the S most confident positions; confidence = the max probability at that position) or
threshold style (Fast-dLLM: every masked position whose confidence exceeds `threshold`, at least
one). Tokens are the argmax (temperature 0) or sampled (temperature, top-p).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import require


@dataclass(frozen=True)
class DecodeParams:
    unmask_per_step: int = 1  # S, vanilla decoding
    threshold: float | None = None  # tau in (0, 1]: threshold decoding instead of vanilla
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        require(self.unmask_per_step >= 1, "unmask_per_step",
                f"must be >= 1, got {self.unmask_per_step}")
        require(self.threshold is None or 0 < self.threshold <= 1, "threshold",
                f"must be in (0, 1], got {self.threshold}")
        require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
