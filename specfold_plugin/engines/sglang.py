"""SGLang adapter for SpecFold: `--dllm-algorithm SpecFold --dllm-algorithm-config specfold.yaml`.

The config is Spiffy's (graph file, D = `budget`, D* = `keep`, rule) plus `delta`, the fold
threshold: a draft position whose residual differs from its parent's by at most delta reuses the
parent's QKV/FFN (delta = 0 folds only exact repeats); inside SGLang the folding runs in a
HookRegistry hook on the SDAR decoder layer (`sglang_fold.py`, driven by `sglang_algorithm.py`).
Imports no SGLang at module import. SGLang < 0.5.21 runs SpecFold unfolded (see
`spiffy_plugin.engines.versions`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from spiffy_plugin.engines.sglang import (
    ALGORITHMS,
    SpiffyConfig,
    SpiffyYaml,
    read_yaml,
    register_dllm_algorithm,
    spiffy_config,
)
from spiffy_plugin.engines.versions import (
    LEGACY_SPECFOLD,
    SGLANG_LAYER_BOUNDARY,
    describe,
    installed,
    sglang_at_least,
)

from ..specfold import DEFAULT_DELTA

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpecFoldConfig:
    spiffy: SpiffyConfig
    delta: float


class SpecFoldYaml(SpiffyYaml):
    delta: float = Field(DEFAULT_DELTA, ge=0)  # the fold threshold


def parse_specfold_config(raw: Any, *, block_size: int, mask_id: int) -> SpecFoldConfig:
    """Spiffy's config plus `delta`; a `ConfigError` naming the key and range."""
    y = read_yaml(raw, SpecFoldYaml)
    return SpecFoldConfig(spiffy_config(y, block_size=block_size, mask_id=mask_id), y.delta)


def register() -> None:
    """The `sglang.srt.plugins` entry point `specfold_plugin`: register `--dllm-algorithm
    SpecFold`. Idempotent; needs no Spiffy registration (its class imports Spiffy's), so it works
    whichever entry point SGLang runs first, or alone. The folded SDAR layer is an AROUND hook on
    `SDARBlock.forward` in SGLang's HookRegistry (`sglang_fold.register_fold_hook`); on SGLang <
    0.5.21, whose SDAR layers lack the layer-boundary API the folded layer is written for, no hook
    is registered and a warning says once that SpecFold runs unfolded."""
    first = "SpecFold" not in ALGORITHMS
    register_dllm_algorithm("SpecFold", "specfold_plugin.engines.sglang_algorithm:SpecFold",
                            "specfold_plugin.engines.sglang:parse_specfold_config")
    if not first:
        return
    if sglang_at_least(SGLANG_LAYER_BOUNDARY):
        from .sglang_fold import register_fold_hook

        register_fold_hook()
    else:
        logger.warning(LEGACY_SPECFOLD, describe(installed("sglang")))
