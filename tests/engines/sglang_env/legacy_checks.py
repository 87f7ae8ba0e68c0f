"""Checks against the real sglang==0.5.16 (the oldest supported) and transformers==5.12.1, run by
`tests/engines/test_versions.py` in a subprocess with `-p tests.engines.sglang_env.legacy`.

SGLang 0.5.16 has no `get_algorithm_cls` (only `get_algorithm(config)`), no `prepare_inputs` and
no `configure_server_args` in its dLLM algorithm base, no `ReqToTokenPool.alloc_rows` and no
`ForwardBatch.dllm_prompt_mask` (see `spiffy_plugin/engines/versions.py`). Mocked as in
`checks_identity.py`: the model runner (its logits come from our reference runtime) and the
scheduler; SGLang's own dLLM loops, pools and ForwardBatch are real.
"""

import dataclasses
import json
import logging
import os
from importlib import metadata

import pytest
import torch

from tests.engines.sglang_env import legacy

legacy.install()

from sglang.srt.dllm.algorithm import get_algorithm  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from specfold_plugin.engines.sglang_fold import SDAR_FORWARD  # noqa: E402
from spiffy_plugin.engines.sglang_batch import take_free_rows  # noqa: E402
from spiffy_plugin.engines.versions import LEGACY_SPECFOLD  # noqa: E402
from spiffy_plugin.errors import ConfigError  # noqa: E402
from tests.engines.sglang_env.fixtures import FIX, server_args  # noqa: E402

GET = "sglang.srt.dllm.algorithm.get_algorithm"
# The SGLang these checks expect: 0.5.16 in `make setup`'s env; any of 0.5.16-0.5.20 (the same
# legacy API, see versions.py) when pointed at another folder by hand.
VERSION = os.environ.get("SPECDEC_LEGACY_SGLANG", "0.5.16")


def test_environment_is_the_oldest_supported():
    import transformers

    assert metadata.version("sglang") == VERSION
    assert transformers.__version__ == "5.12.1"
    import sglang.srt.dllm.algorithm as algorithm

    assert not hasattr(algorithm, "get_algorithm_cls")  # what the adapters must not hook


def test_entry_point_registers_with_one_clear_warning():
    failed = [r.getMessage() for r in legacy.RECORDS if r.exc_info or "Failed" in r.getMessage()]
    assert not failed, failed  # no "Failed to apply hooks ..." trace
    ours = [r.getMessage() for r in legacy.RECORDS
            if r.levelno >= logging.WARNING and r.name.startswith("specfold_plugin")]
    assert ours == [LEGACY_SPECFOLD % VERSION], ours
    assert "layer-boundary API" in ours[0] and "SpecFold" in ours[0]
    from specfold_plugin.engines.sglang import register as register_specfold
    from spiffy_plugin.engines.sglang import register as register_spiffy

    for register in (register_specfold, register_spiffy, register_specfold, register_spiffy):
        register()
    for target in (GET, "sglang.srt.dllm.config.DllmConfig.from_server_args"):
        assert len(HookRegistry._hooks[target]) == 1, target
        assert target in HookRegistry._patched, target
    assert "sglang.srt.dllm.algorithm.get_algorithm_cls" not in HookRegistry._hooks
    assert SDAR_FORWARD not in HookRegistry._hooks  # no folded layer for 0.5.16's SDAR layers


def test_spiffy_and_specfold_resolve(sdar_dir, graph_path, tmp_path):
    cfg = DllmConfig.from_server_args(server_args(sdar_dir, "Spiffy",
                                                  {"graph": graph_path, "keep": 2}, tmp_path))
    assert (cfg.algorithm, cfg.mask_id, cfg.block_size) == ("Spiffy", 2, 16)  # the checkpoint's
    assert cfg.algorithm_config["banned_token_ids"] == [1, 2]
    algo = get_algorithm(cfg)
    assert (type(algo).__module__, type(algo).__name__) == (
        "spiffy_plugin.engines.sglang_algorithm", "Spiffy")
    assert (algo.cfg.budget, algo.cfg.keep) == (3, 2)
    from sglang.srt.dllm.algorithm.base import DllmAlgorithm

    assert DllmAlgorithm.from_server_args(server_args(  # SGLang's worker path (base.py binding)
        sdar_dir, "Spiffy", {"graph": graph_path}, tmp_path)).cfg.keep == 3
    sa = server_args(sdar_dir, "SpecFold", {"graph": graph_path, "delta": 0.25}, tmp_path)
    algo = get_algorithm(DllmConfig.from_server_args(sa))
    assert (type(algo).__name__, algo.delta) == ("SpecFold", 0.25)
    low = get_algorithm(DllmConfig.from_server_args(server_args(sdar_dir, "LowConfidence", None,
                                                                tmp_path)))
    assert type(low).__name__ == "LowConfidence"  # SGLang's own algorithms intact
    with pytest.raises(RuntimeError, match="Unknown diffusion LLM algorithm: Spify"):
        get_algorithm(DllmConfig.from_server_args(server_args(sdar_dir, "Spify", None,
                                                              tmp_path)))


@pytest.mark.parametrize("algorithm", ["Spiffy", "SpecFold"])
def test_bad_configs_fail_when_sglang_resolves_its_arguments(sdar_dir, graph_path, tmp_path,
                                                             algorithm):
    """SGLang < 0.5.21 never calls `configure_server_args`; our DllmConfig hook checks instead,
    which SGLang's argument resolution runs as `sglang.launch_server` does (0.5.16:
    `prepare_server_args`; later: `ServerArgs.resolve_once`)."""
    for bad, message in (({"keep": 4}, r"keep: must be an integer \[1, 3\], got 4"),
                         ({"kepp": 2}, r"unknown keys \['kepp'\]")):
        with pytest.raises(ConfigError, match=message):
            sa = server_args(sdar_dir, algorithm, {"graph": graph_path, **bad}, tmp_path)
            getattr(sa, "resolve_once", lambda: None)()


class _Pool:
    """The mock scheduler's row allocation on SGLang 0.5.16's ReqToTokenPool, which has no
    `alloc_rows` / `free_rows` (our adapter's fallback does the same)."""

    @staticmethod
    def wrap(pool_cls):
        return type("ReqToTokenPool", (pool_cls,), {
            "alloc_rows": take_free_rows, "free_rows": lambda self, rows:
            self.free_slots.extend(rows)})


def _legacy_batch(**fields):
    """`ForwardBatch` as SGLang 0.5.16 builds it: without `dllm_prompt_mask` (the dLLM loop tells
    the prompt from the mask id)."""
    names = {f.name for f in dataclasses.fields(ForwardBatch)}
    return ForwardBatch(**{k: v for k, v in fields.items() if k in names})


@pytest.mark.parametrize("fdfo", [False, True])
def test_legacy_sglang_loops_with_spiffy_drafts_match_reference(sdar_dir, graph_path, tmp_path,
                                                                fdfo, monkeypatch):
    from tests.engines.sglang_env import checks_identity as ci

    monkeypatch.setattr(ci, "ReqToTokenPool", _Pool.wrap(ci.ReqToTokenPool))
    monkeypatch.setattr(ci, "ForwardBatch", _legacy_batch)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sdar_dir, dtype=torch.float32).eval()
    ci.test_sglang_loops_with_spiffy_drafts_match_reference(sdar_dir, graph_path, tmp_path,
                                                            model, fdfo, "1", monkeypatch)


def test_transformers_5_12_runs_our_core_packages():
    """transformers 5.12.1: our DFlash drafter through `dflash_plugin.checkpoint`, greedy
    speculative decoding equal to plain decoding, and Spiffy's reference decoder; the tokens go to
    $SPECDEC_VERSIONS_OUT for the outer test to compare with the main environment's."""
    from dflash_plugin.checkpoint import load_drafter
    from dflash_plugin.generate import speculative_generate
    from dflash_plugin.loading import load_target
    from dflash_plugin.proposers import DFlashProposer
    from spiffy_plugin.decode import generate
    from tests.engines.sglang_env.fixtures import DLLM

    target, tok = load_target(str(FIX / "code-target"), "cpu", torch.float32)
    drafter = load_drafter(FIX / "code-target-dflash-b16")
    ids = tok("import numpy as np\n\n\ndef softmax(x, axis=-1):").input_ids
    spec = speculative_generate(target, DFlashProposer(drafter), [ids], block_size=16,
                                max_new_tokens=24)
    with torch.no_grad():
        plain = target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    plain = plain[0, len(ids):].tolist()
    assert spec.tokens[0] == plain[: len(spec.tokens[0])] and len(spec.tokens[0]) == 24
    assert sum(spec.metrics.requests[0].accepted) > 0  # the drafter is used, not only verified
    from transformers import AutoModelForCausalLM

    dllm = AutoModelForCausalLM.from_pretrained(DLLM, dtype=torch.float32).eval()
    spiffy = generate(dllm, [5, 17, 29], max_new_tokens=16).tokens
    out = os.environ.get("SPECDEC_VERSIONS_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"dflash": spec.tokens[0], "plain": plain, "spiffy": spiffy}, f)
