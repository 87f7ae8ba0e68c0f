"""Decoding parameters of the block-diffusion runtime.

A denoising *step* unmasks some masked positions of the current block: `steps_per_token` style
(vanilla: the S most confident positions; confidence = the max probability at that position) or
threshold style (Fast-dLLM: every masked position whose confidence exceeds `threshold`, at least
one). Tokens are the argmax (temperature 0) or sampled (temperature, top-p).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import config_error


class DecodeParams(BaseModel):
    """Validated on construction: a bad value raises `ConfigError` naming the field, the value
    and the allowed range. Frozen (hashable); `with_(**changes)` is a validated copy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unmask_per_step: int = Field(1, ge=1)  # S, vanilla decoding
    threshold: float | None = Field(None, gt=0, le=1)  # tau: threshold decoding instead
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None

    def __init__(self, **fields: Any):
        try:
            super().__init__(**fields)
        except ValidationError as err:
            raise config_error(type(self), err) from None

    def with_(self, **changes: Any) -> DecodeParams:
        return DecodeParams(**{**self.model_dump(), **changes})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
