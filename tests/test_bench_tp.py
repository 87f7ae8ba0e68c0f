"""The TP flag of the GPU engine benchmarks (issue 22), without an engine: `--tp 2` of
`benchmarks/gpu_engines.py` / `gpu_dllm.py` reaches vLLM's `tensor_parallel_size` and SGLang's
`tp_size` in the keyword arguments the runners pass to `vllm.LLM` / `sgl.Engine` (neither is
imported; no engine is mocked), the engines' environment keeps NVLink multicast off, and the TP
identity helper of the reports counts identical prompts per concurrency and refuses runs of
other configurations.
"""

import pytest

from tests.bench_script import load, on_bench_path


@pytest.fixture(scope="module")
def scripts():
    with on_bench_path():  # the scripts import `bench` as `python benchmarks/X.py` does
        yield load("gpu_engines"), load("gpu_dllm")


def test_engines_tp_reaches_vllm_and_sglang_kwargs(scripts):
    from bench.engine_rows import sglang_kwargs, vllm_kwargs

    engines = scripts[0]
    for mode, draft in (("plain", None), ("dflash", "drafter-dir")):
        for engine, build, key in (("vllm", vllm_kwargs, "tensor_parallel_size"),
                                   ("sglang", sglang_kwargs, "tp_size")):
            args = engines.parse_args(["run", "--engine", engine, "--mode", mode, "--tp", "2",
                                       "--out", "x.json"])
            kw = build(engines.engine_spec(args, "target-dir", draft, max_seqs=16))
            assert kw[key] == 2
            assert ("speculative_config" in kw or "speculative_algorithm" in kw) == bool(draft)
    one = engines.parse_args(["round-cost", "--engine", "vllm", "--mode", "plain", "--out", "x"])
    assert one.tp == 1 and vllm_kwargs(engines.engine_spec(one, "t", None))[
        "tensor_parallel_size"] == 1
    with pytest.raises(SystemExit):
        engines.parse_args(["run", "--engine", "vllm", "--mode", "plain", "--tp", "0",
                            "--out", "x"])


def test_dllm_tp_reaches_sglang_kwargs(scripts):
    from bench.engine_rows import EngineSpec, sglang_kwargs

    args = scripts[1].parse_args(["run", "--work", "w", "--algorithm", "Spiffy", "--tp", "2",
                                  "--out", "x.json"])
    assert args.tp == 2 and args.func is scripts[1].cmd_run
    kw = sglang_kwargs(EngineSpec(engine="sglang", target="w/sdar", draft=None, tp=args.tp,
                                  dllm_algorithm="Spiffy", log_level="info"))
    assert kw["tp_size"] == 2 and kw["dllm_algorithm"] == "Spiffy" and kw["log_level"] == "info"


def test_engine_env_sets_nvls_off_unless_set(scripts, monkeypatch):
    from bench.engine_rows import MULTICAST_OFF, engine_env

    for k in MULTICAST_OFF:
        monkeypatch.delenv(k, raising=False)
    assert engine_env() == MULTICAST_OFF
    assert engine_env()["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "trtllm"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert engine_env() == {**MULTICAST_OFF, "NCCL_NVLS_ENABLE": "1"}


def test_vllm_tp2_runs_without_the_allreduce_rms_fusion(scripts):
    from bench.engine_rows import EngineSpec, vllm_kwargs

    one = vllm_kwargs(EngineSpec(engine="vllm", target="t", draft=None, tp=1))
    two = vllm_kwargs(EngineSpec(engine="vllm", target="t", draft=None, tp=2))
    assert "compilation_config" not in one
    assert two["compilation_config"] == {"pass_config": {"fuse_allreduce_rms": False}}


def _run(tp: int, outputs: dict[int, list[list[int]]], **kw) -> dict:
    doc = {"kind": "engine-run", "engine": "vllm", "mode": "dflash", "tp": tp, "num_prompts": 3,
           "prompt_tokens": [5, 6, 7], "max_tokens": 4, "dtype": "bfloat16",
           "num_spec_tokens": 15,
           "rows": [{"tp": tp, "temperature": t, "concurrency": c, "output_token_ids": ids}
                    for c, ids in outputs.items() for t in (0.0, 1.0)]}
    doc.update(kw)
    return doc


def test_tp_identity_counts_identical_prompts_per_concurrency(scripts):
    from bench.engine_report import render_tp_identity, tp_identity

    one = {1: [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]],
           16: [[1, 2, 3, 4], [5, 6, 7, 0], [9, 9, 9, 9]]}
    two = {1: [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]],
           16: [[1, 2, 0, 0], [5, 6, 7, 8], [9, 9, 9, 9]]}
    res = tp_identity(_run(2, two), _run(1, one))
    assert (res["a_tp"], res["b_tp"], res["run"]) == (2, 1, "vllm dflash")
    r1, r16 = res["rows"]
    assert (r1["concurrency"], r1["identical"], r1["of"], r1["differ"]) == (1, 3, 3, [])
    assert (r16["concurrency"], r16["identical"], r16["of"], r16["differ"]) == (16, 1, 3, [0, 1])
    assert r16["prefix_share"] == round((0.5 + 0.75 + 1) / 3, 4)
    assert r16["a_lowest_vs_this"]["identical"] == 2 and r16["b_lowest_vs_this"]["identical"] == 2
    md = render_tp_identity([_run(1, one), _run(2, two)])
    assert "TP 2 vs TP 1" in md and "| 16 | 1 / 3 |" in md and "| 1 | 3 / 3 |" in md
    assert render_tp_identity([_run(1, one)]) == ""  # no TP 2 run: no section


def test_tp_identity_reads_dllm_rows_and_refuses_other_configurations(scripts):
    from bench.engine_report import tp_identity

    def dllm(tp, algorithm="Spiffy", ids=((1, 2), (3, 4))):
        return {"kind": "dllm-run", "engine": "sglang", "algorithm": algorithm,
                "cuda_graphs": True, "tp": tp, "num_prompts": 2, "prompt_tokens": [3, 3],
                "max_tokens": 2, "dtype": "bfloat16",
                "rows": [{"concurrency": 8, "token_ids": [list(x) for x in ids]}]}

    res = tp_identity(dllm(2, ids=((1, 2), (3, 0))), dllm(1))
    assert res["run"] == "sglang Spiffy graphs on"
    assert [(r["identical"], r["of"], r["differ"]) for r in res["rows"]] == [(1, 2, [1])]
    with pytest.raises(ValueError, match="configuration"):
        tp_identity(dllm(2), dllm(1, algorithm="LowConfidence"))
    with pytest.raises(ValueError, match="max_tokens"):
        tp_identity(_run(2, {1: [[1]]}, max_tokens=8), _run(1, {1: [[1]]}))


def test_dllm_block_counts_take_one_rank_of_a_tp_log(scripts, tmp_path):
    line = "[2026-12-01 10:00:00{}] Spiffy block: rid=r{} forwards={} steps={} accepted=1 x\n"
    log = tmp_path / "engine.log"
    log.write_text("noise\n" + "".join(line.format(tag, i, 3, 9) for i in range(2)
                                       for tag in (" TP0", " TP1")))
    got = scripts[1].block_counts(log, 0)
    assert (got["blocks"], got["forwards"], got["steps"], got["one_step_forwards"]) == (2, 6, 18,
                                                                                       20)
    assert got["block_lines_per_rank"] == {"0": 2, "1": 2}
    log.write_text(line.format("", 0, 4, 7))  # TP = 1: no rank tag, no per-rank counts
    assert scripts[1].block_counts(log, 0) == {"blocks": 1, "forwards": 4, "steps": 7,
                                               "one_step_forwards": 8}
