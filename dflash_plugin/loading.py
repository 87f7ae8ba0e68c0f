"""Loading a target: a Hugging Face causal LM + its tokenizer from a local folder (offline), in
one of the `DTYPES` the command line accepts. Used by `dflash generate`, `make-data` and `train`."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import require

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(path: str, device: str, dtype: torch.dtype):
    """Target model + tokenizer from a Hugging Face folder (offline)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require(Path(path, "config.json").is_file(), "--target", f"no config.json in {path}")
    tok = AutoTokenizer.from_pretrained(path)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tok
