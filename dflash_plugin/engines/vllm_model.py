"""vLLM's DFlash drafter class with a start-up check against the target (see `vllm.py`).

Imported lazily by vLLM's model registry, inside vLLM processes only.
"""

from __future__ import annotations

import logging

from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from ..checkpoint import check_serving_config

logger = logging.getLogger(__name__)


def validate_vllm_drafter(vllm_config) -> None:
    """Raise `ConfigError` (field, value, allowed range) if the drafter does not fit the target."""
    spec = vllm_config.speculative_config
    draft = spec.draft_model_config.hf_config.to_dict()
    if "dflash_config" not in draft and isinstance(draft.get("model"), dict):
        draft = draft["model"]  # vLLM may wrap the drafter's config (EAGLEConfig.model)
    target = vllm_config.model_config.hf_config.get_text_config()
    cfg = check_serving_config(draft, target, spec.num_speculative_tokens)
    if spec.num_speculative_tokens > cfg.block_size - 1:
        logger.warning("num_speculative_tokens=%d exceeds the drafter's trained block (%d - 1)",
                       spec.num_speculative_tokens, cfg.block_size)


class ValidatedDFlashQwen3ForCausalLM(DFlashQwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        validate_vllm_drafter(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
