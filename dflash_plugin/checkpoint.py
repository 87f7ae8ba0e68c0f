"""Load and save DFlash drafters in the z-lab checkpoint format, and build new ones for a target.

A checkpoint folder holds `config.json` (see `config.py`) and safetensors weights named
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `...q_norm/k_norm`, `layers.{i}.mlp.{gate,up,down}
_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`, `fc.weight`,
`hidden_norm.weight`, `norm.weight`, in one file or sharded with an index.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .config import DFlashConfig, build_target_layer_ids, load_config, save_config
from .errors import ConfigError, require
from .model import DFlashDraftModel

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / WEIGHTS_FILE).is_file():
        return load_file(str(folder / WEIGHTS_FILE))
    index = folder / INDEX_FILE
    require(index.is_file(), "weights", f"neither {WEIGHTS_FILE} nor {INDEX_FILE} in {folder}")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(folder / shard)))
    return state


def load_drafter(
    folder: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DFlashDraftModel:
    """Read a z-lab format drafter; every expected weight must be present with its exact shape."""
    folder = Path(folder)
    cfg = load_config(folder)
    model = DFlashDraftModel(cfg)
    expected = model.state_dict()
    state = _read_state(folder)
    missing = sorted(set(expected) - set(state))
    require(not missing, "weights", f"missing from {folder}: {missing[:5]}")
    for name, tensor in expected.items():
        got = tuple(state[name].shape)
        require(got == tuple(tensor.shape), name,
                f"shape {got} does not match the config (expected {tuple(tensor.shape)})")
    model.load_state_dict({k: state[k] for k in expected}, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def save_drafter(model: DFlashDraftModel, folder: str | Path,
                 dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors; returns the folder."""
    folder = Path(folder)
    save_config(model.config, folder)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return folder


def config_for_target(
    target_config: Any,  # a transformers PretrainedConfig of the target
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
) -> DFlashConfig:
    """A drafter config whose layer shapes follow the target's (Qwen3-style layer fields)."""
    t = target_config
    n_target = t.num_hidden_layers
    if mask_token_id is None:
        mask_token_id = getattr(t, "mask_token_id", None)
    require(mask_token_id is not None, "mask_token_id",
            "the target config has none; pass the id of the tokenizer's mask token")
    heads = t.num_attention_heads
    rope = getattr(t, "rope_parameters", None) or {}
    raw = {
        "architectures": ["DFlashDraftModel"],
        "block_size": block_size,
        "num_target_layers": n_target,
        "dflash_config": {
            "mask_token_id": int(mask_token_id),
            "target_layer_ids": target_layer_ids or build_target_layer_ids(n_target, num_layers),
        },
        "hidden_size": t.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(t, "num_key_value_heads", heads) or heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // heads,
        "intermediate_size": t.intermediate_size,
        "rms_norm_eps": getattr(t, "rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", getattr(t, "rope_theta", 1_000_000.0)),
        "vocab_size": t.vocab_size,
        "max_position_embeddings": t.max_position_embeddings,
    }
    return DFlashConfig.from_dict(raw)


def init_drafter(cfg: DFlashConfig, seed: int = 0, std: float = 0.02) -> DFlashDraftModel:
    """A randomly initialised drafter (normal(0, std) linears, unit norms), reproducible by seed."""
    gen = torch.Generator().manual_seed(seed)
    model = DFlashDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()


def check_compatible(cfg: DFlashConfig, target_config: Any) -> None:
    """Raise `ConfigError` unless the drafter can run with this target."""
    t = target_config
    require(cfg.hidden_size == t.hidden_size, "hidden_size",
            f"drafter hidden_size={cfg.hidden_size} != target hidden_size={t.hidden_size}")
    require(cfg.num_target_layers == t.num_hidden_layers, "num_target_layers",
            f"drafter was built for {cfg.num_target_layers} target layers, the target has "
            f"{t.num_hidden_layers}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.num_hidden_layers]
    require(not bad, "dflash_config.target_layer_ids",
            f"{bad} outside the target's layers [0, {t.num_hidden_layers})")
    require(0 <= cfg.mask_token_id < t.vocab_size, "dflash_config.mask_token_id",
            f"{cfg.mask_token_id} outside the target vocabulary [0, {t.vocab_size})")
    if cfg.vocab_size != t.vocab_size:
        raise ConfigError("vocab_size", f"drafter vocab_size={cfg.vocab_size} != target "
                          f"vocab_size={t.vocab_size}")


def check_serving_config(draft_raw: dict[str, Any], target_config: Any,
                         num_speculative_tokens: int | None) -> DFlashConfig:
    """Engine start-up check of a drafter against its target (used by the engine adapters).

    Raises `ConfigError` for a malformed drafter config, a drafter built for another target
    (hidden size, layer count, target layer ids, vocabulary), or num_speculative_tokens < 1.
    Drafting more than block_size - 1 tokens is allowed (block-size generalisation)."""
    cfg = DFlashConfig.from_dict({**draft_raw, "architectures": ["DFlashDraftModel"]})
    check_compatible(cfg, target_config)
    k = num_speculative_tokens
    require(k is None or k >= 1, "num_speculative_tokens", f"must be >= 1, got {k}")
    return cfg
