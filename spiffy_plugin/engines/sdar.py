"""Convert a block-diffusion checkpoint of this project into one SGLang serves as SDAR.

Our dLLM checkpoints are Qwen3-architecture folders whose config adds `dllm_block_size` and
`mask_token_id`. SGLang's `SDARForCausalLM` has the same layers and weight names (q/k/v/o,
q_norm/k_norm, gate/up/down, tied embedding), so conversion rewrites only `config.json`:
`architectures` becomes `["SDARForCausalLM"]` (SGLang picks its model class from it) while
`model_type` stays `qwen3`, so transformers and this project's runtime load the result unchanged.
Weights and tokenizer files are copied byte for byte. A tied LM head is written out as its own
tensor (`lm_head.weight`, the embedding's exact bytes, in one more shard) and the config unties
it: SGLang 0.5.23's SDAR `load_weights` looks up `lm_head.weight` for tied checkpoints, which
its parameter list does not have when the head is tied (KeyError at load).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import require

SDAR_ARCHITECTURE = "SDARForCausalLM"
# SGLang's SDAR attention reads `config.rope_theta` (default 10000) and nothing else about RoPE;
# transformers >= 5 keeps the base only in `rope_parameters`, so other bases cannot be carried.
SDAR_ROPE_THETA = 10000.0
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
INDEX = "model.safetensors.index.json"
HEAD_SHARD = "model-lm_head.safetensors"
BODY_SHARD = "model-body.safetensors"  # a single-file checkpoint's file, renamed when untying


def check_convertible(cfg: dict) -> None:
    """Raise `ConfigError` unless `cfg` (a config.json dict) describes a model SDAR can run."""
    require(cfg.get("model_type") == "qwen3", "model_type",
            f"only Qwen3-architecture checkpoints convert to SDAR, got {cfg.get('model_type')!r}")
    for key in ("dllm_block_size", "mask_token_id"):
        require(cfg.get(key) is not None, key,
                "missing from config.json: not a block-diffusion checkpoint of this project")
    vocab = int(cfg["vocab_size"])
    require(0 <= int(cfg["mask_token_id"]) < vocab, "mask_token_id",
            f"must be in [0, vocab_size={vocab}), got {cfg['mask_token_id']}")
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", SDAR_ROPE_THETA)))
    require(rope.get("rope_type", "default") == "default", "rope_parameters.rope_type",
            f"SGLang's SDAR model supports only default RoPE, got {rope.get('rope_type')!r}")
    require(theta == SDAR_ROPE_THETA, "rope_parameters.rope_theta",
            f"SGLang's SDAR model reads config.rope_theta, which transformers>=5 configs do not "
            f"keep, so it always uses {SDAR_ROPE_THETA:g}; this checkpoint uses {theta:g}")
    require(not cfg.get("use_sliding_window"), "use_sliding_window",
            "SGLang's SDAR model has no sliding-window attention")


def convert_to_sdar(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `out_dir`: the same files as `model_dir`, config.json naming SDARForCausalLM."""
    src, out = Path(model_dir), Path(out_dir)
    require((src / "config.json").is_file(), "--model", f"no config.json in {src}")
    require(src.resolve() != out.resolve(), "--out", "must differ from --model")
    cfg = json.loads((src / "config.json").read_text())
    check_convertible(cfg)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != "config.json":
            shutil.copyfile(f, out / f.name)
    if cfg.get("tie_word_embeddings", False):  # absent: Qwen3Config's default, untied
        _untie_head(src, out)
        cfg["tie_word_embeddings"] = False
    cfg["architectures"] = [SDAR_ARCHITECTURE]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def _untie_head(src: Path, out: Path) -> None:
    """Write the embedding as `lm_head.weight` into its own shard and index it. A single-file
    checkpoint's file is renamed (same bytes) so that loaders read the index, not just it."""
    index_path = src / INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        single = src / "model.safetensors"
        require(single.is_file(), "--model", f"no safetensors weights in {src}")
        with safe_open(str(single), "pt") as f:
            names = f.keys()
        (out / "model.safetensors").rename(out / BODY_SHARD)
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, BODY_SHARD)}
    require(EMBED in index["weight_map"], "weights", f"{EMBED} missing from {src}")
    require(HEAD not in index["weight_map"], "tie_word_embeddings",
            f"true, but the checkpoint also holds {HEAD}")
    with safe_open(str(out / index["weight_map"][EMBED]), "pt") as f:
        embed = f.get_tensor(EMBED)
    save_file({HEAD: embed.contiguous()}, str(out / HEAD_SHARD), metadata={"format": "pt"})
    index["weight_map"][HEAD] = HEAD_SHARD
    if "total_size" in index.get("metadata", {}):
        index["metadata"]["total_size"] += embed.numel() * embed.element_size()
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
