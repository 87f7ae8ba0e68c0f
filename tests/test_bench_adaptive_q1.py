"""`--mode adaptive-q1` of `benchmarks/gpu_engines.py` (issue 20), without an engine: it reaches
SGLang's keyword arguments as our DFLASH_ADAPTIVE with a copy of the tune report that holds only
its plain (k = 0) cells, so every decode step is the worker's q = 1 step; vLLM refuses it before
any engine starts (neither engine is imported; none is mocked)."""

import json
from pathlib import Path

import pytest

from tests.bench_script import BENCH, load, on_bench_path

REPORT = BENCH / "results" / "gpu-engines" / "tune-sglang.json"


@pytest.fixture(scope="module")
def engines():
    with on_bench_path():
        yield load("gpu_engines")


def test_adaptive_q1_reaches_sglang_as_dflash_adaptive_with_plain_cells_only(engines):
    from bench.engine_rows import sglang_kwargs

    args = engines.parse_args(["round-cost", "--engine", "sglang", "--mode", "adaptive-q1",
                               "--shape", "qwen3-8b", "--out", "x.json"])
    assert Path(args.adaptive_config) == REPORT  # the committed report, read by default
    kw = sglang_kwargs(engines.engine_spec(args, "target-dir", "drafter-dir", max_seqs=1))
    assert kw["speculative_algorithm"] == "DFLASH_ADAPTIVE"
    assert kw["speculative_draft_model_path"] == "drafter-dir"
    assert kw["speculative_num_draft_tokens"] == 16  # the longest q (W) stays the drafter's
    doc = json.loads(Path(kw["speculative_adaptive_config"]).read_text())
    source = json.loads(REPORT.read_text())
    assert doc["cells"] == [c for c in source["cells"] if c["k"] == 0]
    assert doc["cells"] and len(doc["cells"]) < len(source["cells"])


def test_adaptive_q1_is_refused_for_vllm(engines):
    from bench.engine_rows import EngineSpec, vllm_kwargs

    args = engines.parse_args(["run", "--engine", "vllm", "--mode", "adaptive-q1",
                               "--out", "x.json"])
    with pytest.raises(SystemExit, match="adaptive-q1 needs --engine sglang"):
        engines.engine_spec(args, "target-dir", "drafter-dir")
    with pytest.raises(ValueError, match="adaptive_config"):
        vllm_kwargs(EngineSpec(engine="vllm", target="t", draft="d", adaptive_config="c.json"))


def test_round_cost_batch_is_checked_before_any_engine_starts(engines):
    """`round-cost --batch 0` stops with the flag and its range before any engine is started;
    the default is one request."""
    args = engines.parse_args(["round-cost", "--engine", "sglang", "--mode", "adaptive-q1",
                               "--batch", "0", "--out", "x.json"])
    with pytest.raises(SystemExit, match=r"--batch must be >= 1 .* got 0"):
        engines.cmd_round_cost(args)
    assert engines.parse_args(["round-cost", "--engine", "sglang", "--mode", "plain",
                               "--out", "x"]).batch == 1
