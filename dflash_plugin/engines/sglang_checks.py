"""Checks against the installed SGLang, shared by the DFlash adapters: a drafter read by SGLang's
own loader and DFlash parser (`check_draft_for_sglang`), and the installed version."""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from ..checkpoint import check_serving_config


def sglang_version() -> tuple[int, ...] | None:
    """(major, minor, patch) of the installed SGLang, or None."""
    try:
        text = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


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
