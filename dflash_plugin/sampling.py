"""Sampling parameters and the logits -> probabilities transform shared by target and drafter.

Temperature 0 means greedy (argmax). For temperature > 0 the same transform (temperature, then
top-k, then top-p nucleus) is applied to the target's p and the drafter's q, so rejection sampling
reproduces exactly the target's transformed distribution.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from specdec_kernels.sampling import top_k_filter, top_p_filter

from .errors import config_error


class SamplingParams(BaseModel):
    """Validated on construction: a bad value raises `ConfigError` naming the field, the value
    and the allowed range. Positional arguments in field order, as before."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0 disables top-k
    seed: int | None = None

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, **extra: Any):
        try:
            super().__init__(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                             **extra)
        except ValidationError as err:
            raise config_error(type(self), err) from None

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
