"""Spiffy as an SGLang dLLM algorithm (imported lazily, inside SGLang processes only).

What runs: the algorithm config is validated at launch (`configure_server_args`) and again when
the scheduler builds the algorithm; each denoising step applies the graph's decoding rule with
the reference runtime's own functions, so greedy output equals `spiffy generate`'s token for
token. Not yet wired: scoring the D* draft blocks in the same forward (as extra sequences sharing
the committed prefix); until then each forward advances one step, as vanilla decoding does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.dllm.algorithm.base import DllmAlgorithm
from sglang.srt.dllm.config import DllmConfig

from .sglang import denoise_step, parse_spiffy_config

logger = logging.getLogger(__name__)


class Spiffy(DllmAlgorithm):
    """`--dllm-algorithm Spiffy --dllm-algorithm-config spiffy.yaml` (see the README)."""

    parse = staticmethod(parse_spiffy_config)

    def __init__(self, config: DllmConfig):
        super().__init__(config)
        self.cfg = self.parse(config.algorithm_config, block_size=config.block_size,
                              mask_id=config.mask_id)
        logger.info("%s: graph %s (D=%d, D*=%d, rule %s); draft scoring is not wired in SGLang "
                    "yet, one denoising step per forward", type(self).__name__,
                    self.cfg.graph_path, self.cfg.budget, self.cfg.keep, self.cfg.graph.rule)

    @classmethod
    def configure_server_args(cls, server_args) -> None:
        """Fail at launch, before any model loads, on a bad algorithm config."""
        config = DllmConfig.from_server_args(server_args)
        cls.parse(config.algorithm_config, block_size=config.block_size, mask_id=config.mask_id)

    def init_step_state(self, forward_batch) -> list[Any]:
        ids = forward_batch.input_ids.view(forward_batch.batch_size, self.block_size)
        prompt = forward_batch.dllm_prompt_mask
        return list(prompt if prompt is not None else ids != self.mask_id)

    def step(self, forward_batch, full_logits: torch.Tensor, states: list[Any]) -> list[bool]:
        bs = forward_batch.batch_size
        ids = forward_batch.input_ids.view(bs, self.block_size).clone()
        logits = full_logits.view(bs, self.block_size, -1)
        done = denoise_step(ids, logits, torch.stack(list(states)), self.cfg)
        forward_batch.input_ids.copy_(ids.view(-1))  # in place: CUDA-graph safe
        return done
