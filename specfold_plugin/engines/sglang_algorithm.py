"""SpecFold as an SGLang dLLM algorithm (imported lazily, inside SGLang processes only).

Folding is NOT applied inside SGLang: it skips QKV/FFN per draft position inside every layer,
which needs per-layer model code that SGLang's model classes do not expose to an algorithm.
SpecFold validates its full config (graph, D, D*, delta) and then runs Spiffy's verification
(`spiffy_plugin.engines.sglang_algorithm`: the D* drafts scored densely as extra sequences in
the root's forward), so its output is Spiffy's exact one, never an approximation shown as folded.
"""

from __future__ import annotations

import logging

from spiffy_plugin.engines.sglang_algorithm import Spiffy

from .sglang import parse_specfold_config

logger = logging.getLogger(__name__)


def _parse(raw, *, block_size: int, mask_id: int):
    return parse_specfold_config(raw, block_size=block_size, mask_id=mask_id).spiffy


class SpecFold(Spiffy):
    parse = staticmethod(_parse)

    def __init__(self, config):
        super().__init__(config)
        self.delta = parse_specfold_config(config.algorithm_config, block_size=config.block_size,
                                           mask_id=config.mask_id).delta
        logger.warning("SpecFold (delta=%g): folding is not implemented in the SGLang adapter; "
                       "running Spiffy's verification (drafts scored densely, exact)", self.delta)
