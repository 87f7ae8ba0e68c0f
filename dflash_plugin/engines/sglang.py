"""SGLang adapter for DFlash: checks of a drafter against SGLang's own loader.

SGLang (0.5.23) serves z-lab checkpoints natively (`--speculative-algorithm DFLASH
--speculative-draft-model-path DIR`); its parser reads `dflash_config.{mask_token_id,
target_layer_ids}`, `block_size` and `num_target_layers`, so a drafter trained here runs there
unchanged. What SGLang lacks is registered under a name of its own by the `sglang.srt.plugins`
entry point `dflash_plugin` (`register`): DFLASH_TREE, tree drafting verified through SGLang's
EAGLE tree path (`sglang_tree_algo.py`). `check_draft_for_sglang` runs SGLang's own parser and
target-layer selection on a drafter plus our pair check. Builtin algorithm names are reserved in
SGLang; features SGLang lacks will register under names of their own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..checkpoint import check_serving_config


def check_draft_for_sglang(draft_dir: str | Path, target_config: Any,
                           num_draft_tokens: int | None = None) -> dict:
    """Load a drafter's config with SGLang's loader and DFlash parser (as its launcher does),
    resolve the capture layers for `target_config` as SGLang does, and run our pair check.
    Returns what SGLang will use."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    raw = json.loads((Path(draft_dir) / "config.json").read_text())
    hf = get_config(str(draft_dir), trust_remote_code=False)
    parsed = parse_dflash_draft_config(draft_hf_config=hf)
    layers = parsed.resolve_target_layer_ids(
        target_num_layers=target_config.num_hidden_layers,
        draft_num_layers=parsed.require_num_layers())
    k = None if num_draft_tokens is None else num_draft_tokens - 1
    ours = check_serving_config(raw, target_config, k)
    return {"block_size": parsed.resolve_block_size(default=16), "mask_token_id":
            parsed.mask_token_id, "mask_token": parsed.mask_token, "target_layer_ids": layers,
            "ours": ours}


def register() -> None:
    """The `sglang.srt.plugins` entry point `dflash_plugin` (loaded by SGLang's launcher, engine,
    scheduler and detokenizer; SGLang's loader logs a failure). Idempotent: registers the
    speculative algorithm DFLASH_TREE once, and its CUDA-graph capture hook."""
    from .sglang_tree_algo import register as register_tree

    register_tree()
