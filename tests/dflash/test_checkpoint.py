import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_plugin.checkpoint import config_for_target, init_drafter, load_drafter, save_drafter
from dflash_plugin.errors import ConfigError

ZLAB_NAMES = {
    "fc.weight", "hidden_norm.weight", "norm.weight",
    *(f"layers.{i}.{n}" for i in range(2) for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight")),
}


@pytest.fixture
def drafter(qwen3_target):
    cfg = config_for_target(qwen3_target.config, num_layers=2, block_size=8, mask_token_id=3)
    return init_drafter(cfg, seed=3, std=0.1)


def test_weight_names_are_zlab(drafter, tmp_path):
    save_drafter(drafter, tmp_path)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == ZLAB_NAMES


def test_save_load_roundtrip(drafter, tmp_path):
    save_drafter(drafter, tmp_path, dtype=torch.float32)
    loaded = load_drafter(tmp_path)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_sharded_checkpoint_loads(drafter, tmp_path):
    save_drafter(drafter, tmp_path, dtype=torch.float32)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_drafter(tmp_path)
    assert torch.equal(loaded.fc.weight, drafter.fc.weight)


def test_missing_and_misshaped_weights(drafter, tmp_path):
    save_drafter(drafter, tmp_path, dtype=torch.float32)
    state = load_file(str(tmp_path / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k != "fc.weight"},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="fc.weight"):
        load_drafter(tmp_path)
    state["fc.weight"] = torch.zeros(64, 64)  # config says 2 target layers -> 128 inputs
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="fc.weight"):
        load_drafter(tmp_path)


def test_missing_weights_file(drafter, tmp_path):
    save_drafter(drafter, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="weights"):
        load_drafter(tmp_path)
