"""SGLang adapter for SpecFold: `--dllm-algorithm SpecFold --dllm-algorithm-config specfold.yaml`.

The config is Spiffy's (graph file, D = `budget`, D* = `keep`, rule) plus `delta`, the fold
threshold: a draft position whose residual differs from its parent's by at most delta reuses the
parent's QKV/FFN (delta = 0 folds only exact repeats); inside SGLang the folding runs in a wrapper
of the SDAR decoder layer (`sglang_fold.py`, driven by `sglang_algorithm.py`). Imports no SGLang
at module import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spiffy_plugin.engines.sglang import (
    FIELD,
    SpiffyConfig,
    parse_spiffy_config,
    register_dllm_algorithm,
)
from spiffy_plugin.errors import require

DEFAULT_DELTA = 0.1


@dataclass(frozen=True)
class SpecFoldConfig:
    spiffy: SpiffyConfig
    delta: float


def parse_specfold_config(raw: Any, *, block_size: int, mask_id: int) -> SpecFoldConfig:
    cfg = parse_spiffy_config(raw, block_size=block_size, mask_id=mask_id,
                              extra_keys=frozenset({"delta"}))
    delta = raw.get("delta", DEFAULT_DELTA)
    ok = isinstance(delta, (int, float)) and not isinstance(delta, bool) and delta >= 0
    require(ok, f"{FIELD}: delta", f"the fold threshold must be a number >= 0, got {delta!r}")
    return SpecFoldConfig(cfg, float(delta))


def register() -> None:
    register_dllm_algorithm("SpecFold", "specfold_plugin.engines.sglang_algorithm:SpecFold")
