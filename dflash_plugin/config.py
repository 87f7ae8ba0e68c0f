"""DFlash drafter configuration in the public z-lab checkpoint format.

A drafter config is a Qwen3 layer config plus the DFlash fields: `block_size` (tokens proposed per
round, anchor included), `num_target_layers` (depth of the target it was built for) and
`dflash_config = {mask_token_id, target_layer_ids}`. Target layer ids index decoder-layer OUTPUTS
of the target (Hugging Face `hidden_states[id + 1]`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import ConfigError, require, validated

MIN_BLOCK_SIZE = 2
MAX_BLOCK_SIZE = 64
ARCHITECTURE = "DFlashDraftModel"

# Keys that `DFlashConfig.to_dict` writes itself; anything else read from a file is kept as-is.
_OWN_KEYS = {
    "architectures", "model_type", "block_size", "num_target_layers", "dflash_config",
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
    "vocab_size", "max_position_embeddings", "hidden_act", "attention_bias",
}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The z-lab default: one draft layer -> [L // 2]; n > 1 -> evenly spaced over [1, L - 3]."""
    require(num_target_layers >= 1, "num_target_layers", f"must be >= 1, got {num_target_layers}")
    require(num_draft_layers >= 1, "num_hidden_layers", f"must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class DFlashConfig(BaseModel):
    """Validated drafter config. Construct with `DFlashConfig.from_dict` / `load_config`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(ge=MIN_BLOCK_SIZE, le=MAX_BLOCK_SIZE)
    num_target_layers: int = Field(ge=1)
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    rms_norm_eps: float = Field(1e-6, gt=0)
    rope_theta: float = Field(1_000_000.0, gt=0)
    vocab_size: int = Field(ge=1)
    max_position_embeddings: int = Field(40960, ge=1)
    hidden_act: str = "silu"
    attention_bias: bool = False
    extra: dict[str, Any] = {}

    @model_validator(mode="after")
    def _check(self) -> DFlashConfig:
        """The checks across fields (single-field ranges are the `Field` bounds above)."""
        require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                f"must divide num_attention_heads={self.num_attention_heads}, "
                f"got {self.num_key_value_heads}")
        require(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        require(0 <= self.mask_token_id < self.vocab_size, "dflash_config.mask_token_id",
                f"must be in [0, vocab_size={self.vocab_size}), got {self.mask_token_id}")
        require(len(self.target_layer_ids) >= 1, "dflash_config.target_layer_ids",
                "must name at least one target layer")
        for lid in self.target_layer_ids:
            require(0 <= lid < self.num_target_layers, "dflash_config.target_layer_ids",
                    f"id {lid} is outside [0, num_target_layers={self.num_target_layers})")
        require(self.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, got "
                f"{self.hidden_act!r}")
        return self

    @property
    def num_context_features(self) -> int:
        """Width of the concatenated target hidden states that `fc` projects."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlashConfig:
        """Parse a z-lab config.json dict; raise `ConfigError` naming the bad field."""
        raw = dict(raw)
        arch = raw.get("architectures") or [ARCHITECTURE]
        require(ARCHITECTURE in arch, "architectures", f"must contain {ARCHITECTURE!r}, got {arch}")
        dcfg = raw.get("dflash_config")
        require(isinstance(dcfg, dict), "dflash_config",
                "missing: a dict with mask_token_id and target_layer_ids is required")
        block_top, block_inner = raw.get("block_size"), dcfg.get("block_size")
        require(block_top is not None or block_inner is not None, "block_size",
                "missing: set block_size at the top level or inside dflash_config")
        require(block_top is None or block_inner is None or block_top == block_inner, "block_size",
                f"contradicts itself: top level {block_top} vs dflash_config {block_inner}")
        for name in ("num_target_layers", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "intermediate_size", "vocab_size"):
            require(name in raw, name, "missing from the drafter config")
        require("mask_token_id" in dcfg, "dflash_config.mask_token_id", "missing")
        n_layers = raw["num_hidden_layers"]
        layer_ids = dcfg.get("target_layer_ids")
        if layer_ids is None:
            layer_ids = build_target_layer_ids(raw["num_target_layers"], n_layers)
        rope = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        heads = raw["num_attention_heads"]
        fields = {
            "block_size": block_top if block_top is not None else block_inner,
            "num_target_layers": raw["num_target_layers"],
            "mask_token_id": dcfg["mask_token_id"],
            "target_layer_ids": tuple(layer_ids),
            "hidden_size": raw["hidden_size"],
            "num_hidden_layers": n_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": raw.get("num_key_value_heads", heads),
            "head_dim": raw.get("head_dim") or raw["hidden_size"] // heads,
            "intermediate_size": raw["intermediate_size"],
            "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
            "rope_theta": rope_theta,
            "vocab_size": raw["vocab_size"],
            "max_position_embeddings": raw.get("max_position_embeddings", 40960),
            "hidden_act": raw.get("hidden_act", "silu"),
            "attention_bias": raw.get("attention_bias", False),
            "extra": {k: v for k, v in raw.items() if k not in _OWN_KEYS},
        }
        own = ("mask_token_id", "target_layer_ids", "block_size")
        fields["extra"]["dflash_config"] = {k: v for k, v in dcfg.items() if k not in own}
        return _build(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The z-lab config.json dict (Qwen3 layer config + DFlash fields)."""
        extra = dict(self.extra)
        dflash_extra = extra.pop("dflash_config", {})
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {
                **dflash_extra,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "num_target_layers": self.num_target_layers,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
        }
        defaults = {
            "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": True,
            "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers, "dtype": "bfloat16",
        }
        return {**defaults, **extra, **out}

    def replace(self, **changes: Any) -> DFlashConfig:
        """A validated copy with some fields changed."""
        return _build(**{**self.model_dump(), **changes})


def _build(**fields: Any) -> DFlashConfig:
    return validated(DFlashConfig, **fields)


def load_config(path: str | Path) -> DFlashConfig:
    """Read `config.json` from a checkpoint folder (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    require(file.is_file(), "config.json", f"not found at {file}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError("config.json", f"{file} is not valid JSON: {err}") from None
    return DFlashConfig.from_dict(raw)


def save_config(config: DFlashConfig, folder: str | Path) -> Path:
    """Write `config.json` in the z-lab format; returns its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "config.json"
    file.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return file
