import json

import pytest

from dflash_plugin.checkpoint import check_compatible, config_for_target
from dflash_plugin.config import DFlashConfig, build_target_layer_ids, load_config, save_config
from dflash_plugin.errors import ConfigError

BASE = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "num_target_layers": 36, "hidden_size": 4096, "num_hidden_layers": 5,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 12288, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
}


def test_target_layer_ids_follow_zlab_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(36, 1) == [18]
    assert build_target_layer_ids(8, 1) == [4]
    assert build_target_layer_ids(8, 3) == [1, 3, 5]
    assert build_target_layer_ids(28, 4) == [round(1 + i * 24 / 3) for i in range(4)]


def test_derives_layer_ids_when_absent():
    raw = {**BASE, "dflash_config": {"mask_token_id": 7}}
    assert DFlashConfig.from_dict(raw).target_layer_ids == (1, 9, 17, 25, 33)


def test_block_size_inside_dflash_config():
    raw = {k: v for k, v in BASE.items() if k != "block_size"}
    raw["dflash_config"] = {**BASE["dflash_config"], "block_size": 8}
    assert DFlashConfig.from_dict(raw).block_size == 8


def test_roundtrip_keeps_zlab_format(tmp_path):
    cfg = DFlashConfig.from_dict(BASE)
    save_config(cfg, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["block_size"] == 16 and raw["num_target_layers"] == 36
    assert raw["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert raw["tie_word_embeddings"] is False  # unknown keys survive
    assert load_config(tmp_path).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("change,field", [
    ({"block_size": 1}, "block_size"),
    ({"block_size": 65}, "block_size"),
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1], "block_size": 8}},
     "block_size"),
    ({"dflash_config": {"mask_token_id": 151936}}, "dflash_config.mask_token_id"),
    ({"dflash_config": {"mask_token_id": -1}}, "dflash_config.mask_token_id"),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [36]}},
     "dflash_config.target_layer_ids"),
    ({"dflash_config": {"target_layer_ids": [1]}}, "dflash_config.mask_token_id"),
    ({"dflash_config": None}, "dflash_config"),
    ({"num_target_layers": None}, "num_target_layers"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures"),
])
def test_bad_config_names_the_field(change, field):
    raw = {**BASE, **change}
    raw = {k: v for k, v in raw.items() if v is not None or k == "dflash_config"}
    with pytest.raises(ConfigError) as err:
        DFlashConfig.from_dict(raw)
    assert err.value.field == field
    assert field in str(err.value)


def test_missing_block_size():
    raw = {k: v for k, v in BASE.items() if k != "block_size"}
    with pytest.raises(ConfigError, match="block_size"):
        DFlashConfig.from_dict(raw)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_target_compatibility(qwen3_target):
    cfg = config_for_target(qwen3_target.config, num_layers=2, block_size=8, mask_token_id=3)
    check_compatible(cfg, qwen3_target.config)
    with pytest.raises(ConfigError, match="hidden_size"):
        check_compatible(cfg.replace(hidden_size=128), qwen3_target.config)
    with pytest.raises(ConfigError, match="num_target_layers"):
        check_compatible(cfg.replace(num_target_layers=8, target_layer_ids=(6,)),
                         qwen3_target.config)
    with pytest.raises(ConfigError, match="vocab_size"):
        check_compatible(cfg.replace(vocab_size=1000), qwen3_target.config)


def test_serving_check(qwen3_target):
    from dflash_plugin.checkpoint import check_serving_config

    cfg = config_for_target(qwen3_target.config, num_layers=2, block_size=8, mask_token_id=3)
    raw = cfg.to_dict()
    assert check_serving_config(raw, qwen3_target.config, 7).to_dict() == raw
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        check_serving_config(raw, qwen3_target.config, 0)
    with pytest.raises(ConfigError, match="num_target_layers"):
        check_serving_config({**raw, "num_target_layers": 36}, qwen3_target.config, 7)
    with pytest.raises(ConfigError, match="dflash_config"):
        check_serving_config({**raw, "dflash_config": None}, qwen3_target.config, 7)
