"""Sampling parameters and the logits -> probabilities transform shared by target and drafter.

Temperature 0 means greedy (argmax). For temperature > 0 the same transform (temperature, then
top-k, then top-p nucleus) is applied to the target's p and the drafter's q, so rejection sampling
reproduces exactly the target's transformed distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


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
