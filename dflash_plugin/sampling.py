"""Sampling parameters and the logits -> probabilities transform shared by target and drafter.

Temperature 0 means greedy (argmax). For temperature > 0 the same transform (temperature, then
top-k, then top-p nucleus) is applied to the target's p and the drafter's q, so rejection sampling
reproduces exactly the target's transformed distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specdec_kernels.sampling import top_k_filter, top_p_filter

from .errors import require


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None

    def __post_init__(self):
        require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.top_k >= 0, "top_k", f"must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_probs(
    logits: torch.Tensor,  # [..., vocab]
    params: SamplingParams,
) -> torch.Tensor:  # [..., vocab] fp32, rows sum to 1
    """Temperature, top-k and top-p applied in that order; greedy maps to a one-hot."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scores = top_k_filter(logits.float() / params.temperature, params.top_k)
    return top_p_filter(torch.softmax(scores, dim=-1), params.top_p)


def sample_from(
    probs: torch.Tensor,  # [..., vocab]
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [...] long
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def pick_tokens(
    logits: torch.Tensor,  # [..., vocab]
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [...] long
    """Argmax when greedy, else a sample from the transformed distribution."""
    if params.greedy:
        return logits.argmax(-1)
    return sample_from(sampling_probs(logits, params), generator)
