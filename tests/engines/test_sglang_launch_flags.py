"""Both SGLang algorithms' launch-time validators read our environment switches
(DFLASH_FAST_DECODE_PREP, DFLASH_BATCH_ADMISSION; DFLASH_ADAPTIVE's also DFLASH_PREFILL_APPEND):
a bad value is refused before any engine work (server args stand-in: the validators fail before
reading past the switches)."""

import importlib
import types

import pytest

from dflash_plugin.errors import ConfigError


@pytest.mark.parametrize("env,bad", [("DFLASH_FAST_DECODE_PREP", "2"),
                                     ("DFLASH_BATCH_ADMISSION", "1"),
                                     ("DFLASH_PREFILL_APPEND", "yes")])
@pytest.mark.parametrize("module", ["sglang_adaptive", "sglang_tree_algo"])
def test_a_bad_flag_fails_the_launch(monkeypatch, module, env, bad):
    if env == "DFLASH_PREFILL_APPEND" and module == "sglang_tree_algo":
        pytest.skip("DFLASH_PREFILL_APPEND acts in DFLASH_ADAPTIVE's worker only")
    mod = importlib.import_module(f"dflash_plugin.engines.{module}")
    monkeypatch.setenv(env, bad)
    if module == "sglang_adaptive":
        monkeypatch.setattr(mod, "max_block", lambda sa: 16)
        monkeypatch.setattr(mod, "load_step_times", lambda path, w: {})
        args = object()
    else:
        monkeypatch.setattr(mod, "_drafter_block_size", lambda d: 16)
        args = types.SimpleNamespace(speculative_draft_model_path="d",
                                     speculative_dflash_block_size=16,
                                     speculative_num_draft_tokens=32, speculative_eagle_topk=4)
    with pytest.raises(ConfigError, match=env):
        mod.validate_server_args(args)
