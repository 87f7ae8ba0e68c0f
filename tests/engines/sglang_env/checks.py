"""Checks against the real sglang==0.5.23 package, run by `tests/engines/test_sglang.py` in a
subprocess whose path holds `.venv/sglang` (installed by `make setup`) and the torchvision shim.

Nothing of SGLang is mocked except where named: the model runner / forward batch of the
token-identity check (SGLang cannot run its model forward on CPU), whose logits come from our
reference runtime over the same converted checkpoint.
"""

import sys

import pytest

from tests.engines.sglang_env import shims

shims.install()

from sglang.srt.dllm.algorithm import get_algorithm, get_algorithm_cls  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from dflash_plugin.errors import ConfigError as DFlashConfigError  # noqa: E402
from specfold_plugin.engines.sglang_fold import SDAR_FORWARD, fold_hook_applied  # noqa: E402
from spiffy_plugin.errors import ConfigError  # noqa: E402
from tests.engines.sglang_env.fixtures import (  # noqa: E402
    DLLM,
    ENTRY_POINTS,
    FIX,
    server_args,
)


def test_entry_point_registers_algorithms_idempotently():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert {k: eps.get(k) for k in ENTRY_POINTS} == ENTRY_POINTS, (
        f"entry points missing from the installed metadata ({eps}): reinstall (make setup)")
    assert get_algorithm_cls("Spiffy").__module__ == "spiffy_plugin.engines.sglang_algorithm"
    assert get_algorithm_cls("SpecFold").__name__ == "SpecFold"
    assert get_algorithm_cls("LowConfidence").__name__ == "LowConfidence"  # builtins intact
    with pytest.raises(RuntimeError, match="Unknown diffusion LLM algorithm: Spify"):
        get_algorithm_cls("Spify")
    from specfold_plugin.engines.sglang import register as register_specfold
    from spiffy_plugin.engines.sglang import register as register_spiffy

    for register in (register_specfold, register_spiffy, register_specfold, register_spiffy):
        register()
    for target in ("sglang.srt.dllm.algorithm.get_algorithm_cls",
                   "sglang.srt.dllm.config.DllmConfig.from_server_args", SDAR_FORWARD):
        assert len(HookRegistry._hooks[target]) == 1, target
    from sglang.srt.models.sdar import SDARBlock

    assert fold_hook_applied() and SDARBlock.forward.__wrapped__ is not None  # class, not layers


def test_whitelist_names_each_package(monkeypatch):
    """`SGLANG_PLUGINS` selects by entry-point name: each package can be loaded alone."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    for allowed in ("specfold_plugin", "spiffy_plugin", "dflash_plugin",
                    "spiffy_plugin,specfold_plugin"):
        monkeypatch.setenv("SGLANG_PLUGINS", allowed)
        found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
        assert sorted(found) == sorted(allowed.split(",")), found
        for name, (func, dist) in found.items():
            assert f"{func.__module__}:{func.__qualname__}" == ENTRY_POINTS[name]
            assert dist.replace("_", "-") == "specdec-plugins"


def test_spiffy_and_specfold_resolve_from_command_line(sdar_dir, graph_path, tmp_path):
    sa = server_args(sdar_dir, "Spiffy", {"graph": graph_path, "keep": 2}, tmp_path)
    cfg = DllmConfig.from_server_args(sa)
    # the checkpoint's mask token and block size, not SGLang's SDAR table (151669, 4)
    assert (cfg.algorithm, cfg.mask_id, cfg.block_size) == ("Spiffy", 2, 16)
    assert cfg.algorithm_config["eos_token_id"] == 0
    assert cfg.algorithm_config["banned_token_ids"] == [1, 2]
    assert cfg.max_running_requests == 1  # SGLang's dLLM default
    get_algorithm_cls("Spiffy").configure_server_args(sa)
    algo = get_algorithm(cfg)
    assert type(algo).__name__ == "Spiffy"
    assert (algo.cfg.budget, algo.cfg.keep, algo.cfg.params.unmask_per_step) == (3, 2, 1)
    sa = server_args(sdar_dir, "SpecFold", {"graph": graph_path, "budget": 3, "delta": 0.25},
                     tmp_path)
    algo = get_algorithm(DllmConfig.from_server_args(sa))
    assert (type(algo).__name__, algo.delta, algo.cfg.keep) == ("SpecFold", 0.25, 3)
    sa = server_args(sdar_dir, "Spiffy", {"graph": graph_path, "max_running_requests": 3},
                     tmp_path)
    assert DllmConfig.from_server_args(sa).max_running_requests == 3  # the YAML's, for dLLM only
    low = DllmConfig.from_server_args(server_args(sdar_dir, "LowConfidence", None, tmp_path))
    assert (low.mask_id, low.block_size) == (2, 16)  # same model, SGLang's own algorithm


def test_converted_checkpoint_is_an_sdar_model_for_sglang(sdar_dir, tmp_path):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.registry import ModelRegistry
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(DLLM)
    hf = ModelConfig.from_server_args(server_args(sdar_dir, "LowConfidence", None, tmp_path),
                                      model_path=str(sdar_dir)).hf_config
    cls, arch = ModelRegistry.resolve_model_cls(hf.architectures)
    assert (cls.__module__, arch) == ("sglang.srt.models.sdar", "SDARForCausalLM")
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                  "rms_norm_eps", "max_position_embeddings", "attention_bias"):
        assert getattr(hf, field) == getattr(ours, field), field
    # SDAR's attention reads config.rope_theta (default 10000); it must be our base
    assert getattr(hf, "rope_theta", 10000.0) == ours.rope_parameters["rope_theta"]
    assert hf.tie_word_embeddings is False  # the head is an explicit tensor (see sdar.py)


BAD = [
    ({}, "graph: required"),
    ({"graph": "/nonexistent/graph.json"}, "graph: file not found"),
    ({"graph": "@G", "keep": 4}, r"keep: must be an integer \[1, 3\], got 4"),
    ({"graph": "@G", "keep": 0}, r"keep: must be an integer \[1, 3\], got 0"),
    ({"graph": "@G", "budget": 5}, "budget: D=5 but the graph file holds 3 nodes"),
    ({"graph": "@G", "block_size": 8}, "block_size: the graph was calibrated for blocks of 16"),
    ({"graph": "@G", "kepp": 2}, r"unknown keys \['kepp'\]"),
    ({"graph": "@G", "threshold": 0.9}, "threshold: 0.9 differs from the graph's rule"),
    ({"graph": "@G", "max_running_requests": 0}, "max_running_requests: must be >= 1, got 0"),
]


@pytest.mark.parametrize("algorithm", ["Spiffy", "SpecFold"])
@pytest.mark.parametrize("bad,message", BAD)
def test_bad_configs_fail_at_launch_with_clear_messages(sdar_dir, graph_path, tmp_path,
                                                        algorithm, bad, message):
    bad = {k: (graph_path if v == "@G" else v) for k, v in bad.items()}
    sa = server_args(sdar_dir, algorithm, bad, tmp_path)
    with pytest.raises(ConfigError, match=message):
        get_algorithm_cls(algorithm).configure_server_args(sa)


@pytest.mark.parametrize("delta", [-0.1, "big", True])
def test_specfold_rejects_bad_delta(sdar_dir, graph_path, tmp_path, delta):
    sa = server_args(sdar_dir, "SpecFold", {"graph": graph_path, "delta": delta}, tmp_path)
    with pytest.raises(ConfigError, match="delta: must be (a number )?>= 0"):
        get_algorithm_cls("SpecFold").configure_server_args(sa)
    sa = server_args(sdar_dir, "Spiffy", {"graph": graph_path, "delta": 0.1}, tmp_path)
    with pytest.raises(ConfigError, match=r"unknown keys \['delta'\]"):  # Spiffy has no delta
        get_algorithm_cls("Spiffy").configure_server_args(sa)


def test_our_dflash_checkpoint_passes_sglang_parser():
    from sglang.srt.speculative.dflash_utils import build_target_layer_ids as sglang_layers
    from transformers import AutoConfig, AutoTokenizer

    from dflash_plugin.config import build_target_layer_ids, load_config
    from dflash_plugin.engines.sglang import check_draft_for_sglang

    draft, target = FIX / "code-target-dflash-b16", AutoConfig.from_pretrained(FIX / "code-target")
    ours = load_config(draft)
    got = check_draft_for_sglang(draft, target, num_draft_tokens=16)
    assert got["block_size"] == ours.block_size == 16
    assert got["mask_token_id"] == ours.mask_token_id == 2
    assert got["target_layer_ids"] == list(ours.target_layer_ids)
    # SGLang's worker rejects a mask token id that the tokenizer maps to another token
    vocab = AutoTokenizer.from_pretrained(FIX / "code-target").get_vocab()
    assert vocab.get(got["mask_token"], ours.mask_token_id) == ours.mask_token_id
    for n_target in (4, 8, 36, 64):  # drafters without explicit ids pick the same layers
        for n_draft in (1, 2, 3, 5):
            assert sglang_layers(n_target, n_draft) == build_target_layer_ids(n_target, n_draft)
    other = AutoConfig.from_pretrained(FIX / "code-target")
    other.hidden_size = 512
    with pytest.raises(DFlashConfigError, match="hidden_size"):
        check_draft_for_sglang(draft, other)
    other = AutoConfig.from_pretrained(FIX / "code-target")
    other.num_hidden_layers = 2
    with pytest.raises(ValueError, match="out-of-range layer id"):  # SGLang's own check
        check_draft_for_sglang(draft, other)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "tests.engines.sglang_env.fixtures"]))
