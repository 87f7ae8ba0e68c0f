"""The DFLASH_TREE rows of the GPU benchmarks without an engine (SGLang is not imported):
`gpu_tree_sglang.py`'s mode names (any node budget), its engine keywords (width = budget + 1,
the dtype reaching SGLang, graphs without prefill graphs) and its report's greedy identity over
the shorter of two outputs; `gpu_engines.py --mode tree` (SGLang's keywords, refused for vLLM),
and its report with several budgets beside DFlash, in the serving and the round-cost tables.
"""

import json

import pytest

from tests.bench_script import load
from tests.test_bench_tp import scripts  # noqa: F401  (fixture: gpu_engines, gpu_dllm)


@pytest.fixture(scope="module")
def bench(scripts):  # noqa: F811  (scripts: benchmarks/ on sys.path, as `python benchmarks/X.py`)
    return load("gpu_tree_sglang")


@pytest.mark.parametrize("text", ["plain", "dflash", "tree1", "tree15", "tree256"])
def test_modes_accepted(bench, text):
    assert bench.mode(text) == text


@pytest.mark.parametrize("text", ["tree", "tree0", "tree-4", "treex", "eagle", ""])
def test_modes_refused_with_the_field(bench, text):
    with pytest.raises(Exception, match="mode: plain, dflash or treeN"):
        bench.mode(text)


def test_engine_kwargs_per_mode(bench):
    args = bench.parse_args(["run", "--mode", "tree15", "--topk", "1", "--dtype", "float32"])
    kw = bench.engine_kwargs(args, args.mode)
    assert (kw["speculative_algorithm"], kw["speculative_num_draft_tokens"],
            kw["speculative_eagle_topk"], kw["dtype"]) == ("DFLASH_TREE", 16, 1, "float32")
    assert kw["cuda_graph_backend_prefill"] == "disabled" and "disable_cuda_graph" not in kw
    eager = bench.parse_args(["run", "--mode", "plain", "--eager"])
    kw = bench.engine_kwargs(eager, "plain")
    assert kw["disable_cuda_graph"] and "speculative_algorithm" not in kw
    assert kw["dtype"] == "bfloat16"



@pytest.mark.parametrize("mode", ["plain", "dflash", "tree32"])
def test_backend_per_mode_and_fp32_takes_triton(bench, mode):
    """bf16: plain and DFLASH keep SGLang's default backend, trees take flashinfer; fp32 (no
    flashinfer or fa3 kernels) takes triton in every mode, target and drafter alike; an explicit
    --attention-backend applies to every mode."""
    kw = bench.engine_kwargs(bench.parse_args(["run", "--mode", mode]), mode)
    assert kw.get("attention_backend") == ("flashinfer" if mode == "tree32" else None)
    for argv, want in ((["--dtype", "float32"], "triton"),
                       (["--attention-backend", "fa3"], "fa3")):
        kw = bench.engine_kwargs(bench.parse_args(["run", "--mode", mode, *argv]), mode)
        assert kw["attention_backend"] == want
        assert kw.get("speculative_draft_attention_backend") == (None if mode == "plain"
                                                                 else want)
    kw = bench.engine_kwargs(bench.parse_args(["run", "--mode", mode, "--deterministic"]), mode)
    assert kw["enable_deterministic_inference"]


def test_dllm_fp32_needs_eager_triton_and_deterministic_reaches_sglang(scripts):  # noqa: F811
    from bench.engine_rows import EngineSpec, sglang_kwargs, vllm_kwargs

    dllm = scripts[1]
    base = ["run", "--work", "w", "--algorithm", "Spiffy", "--out", "x.json"]
    for extra in (["--dtype", "float32"], ["--dtype", "float32", "--eager"]):
        with pytest.raises(SystemExit):
            dllm.parse_args(base + extra)
    args = dllm.parse_args(base + ["--dtype", "float32", "--eager", "--attention-backend",
                                   "triton"])
    assert args.attention_backend == "triton" and not args.deterministic
    assert dllm.parse_args(base + ["--deterministic"]).deterministic
    # eager dLLM rows default to flashinfer (SGLang's Hopper default fa3 cannot run them)
    assert dllm.parse_args(base + ["--eager"]).attention_backend == "flashinfer"
    assert dllm.parse_args(base).attention_backend is None  # graphs: SGLang's own choice
    kw = sglang_kwargs(EngineSpec(engine="sglang", target="t", draft=None, deterministic=True,
                                  attention_backend="triton"))
    assert kw["enable_deterministic_inference"] and kw["attention_backend"] == "triton"
    assert "speculative_draft_attention_backend" not in kw
    assert "enable_deterministic_inference" not in sglang_kwargs(
        EngineSpec(engine="sglang", target="t", draft=None))
    with pytest.raises(ValueError, match="SGLang keywords"):
        vllm_kwargs(EngineSpec(engine="vllm", target="t", draft=None, deterministic=True))
    with pytest.raises(ValueError, match="SGLang keywords"):
        vllm_kwargs(EngineSpec(engine="vllm", target="t", draft="d",
                               draft_attention_backend="fa3"))


def _doc(mode, rows):
    return {"mode": mode, "rows": [{"concurrency": c, "tokens_per_s": tps, "wall_s": 1.0,
                                    "tau": tau, "tokens": toks} for c, tps, tau, toks in rows]}


def test_report_identity_and_first_difference(bench, tmp_path, capsys):
    plain = [[1, 2, 3, 4], [5, 6, 7, 8]]
    docs = {"plain": _doc("plain", [(1, 100.0, None, plain)]),
            "tree32": _doc("tree32", [(1, 50.0, 5.0, [[1, 2, 9, 4], [5, 6, 7, 8]])]),
            "tree32-short": _doc("tree32", [(1, 80.0, 4.0, [[1, 2], [5, 6]])])}
    for name, doc in docs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    (tmp_path / "other.json").write_text("[1, 2]")  # not a run: skipped
    bench.cmd_report(bench.parse_args(["report", "--out", str(tmp_path)]))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in capsys.readouterr().out.splitlines()[2:]}
    assert list(rows) == ["plain", "tree32-short", "tree32"]
    assert rows["tree32"] == ["1", "50", "0.50", "5.00", "1/2", "2"]
    assert rows["tree32-short"][4:] == ["2/2", "-"]  # equal over the 2 tokens it has


# --- the tree mode of `benchmarks/gpu_engines.py` (warmed rows, T = 0 and 1, 8B round cost) ---


def test_engines_tree_mode_reaches_sglang_kwargs(scripts):  # noqa: F811
    from bench.engine_rows import sglang_kwargs

    engines = scripts[0]
    args = engines.parse_args(["run", "--engine", "sglang", "--mode", "tree",
                               "--num-spec-tokens", "32", "--tree-topk", "4", "--out", "x"])
    kw = sglang_kwargs(engines.engine_spec(args, "target-dir", "drafter-dir", max_seqs=16))
    assert (kw["speculative_algorithm"], kw["speculative_num_draft_tokens"],
            kw["speculative_eagle_topk"], kw["attention_backend"],
            kw["speculative_draft_attention_backend"]) == ("DFLASH_TREE", 33, 4, "flashinfer",
                                                           "flashinfer")
    cost = engines.parse_args(["round-cost", "--engine", "sglang", "--mode", "tree",
                               "--num-spec-tokens", "64", "--out", "x"])
    kw = sglang_kwargs(engines.engine_spec(cost, "t", "d", max_seqs=1, load_format="dummy"))
    assert (kw["speculative_num_draft_tokens"], kw["speculative_eagle_topk"],
            kw["load_format"]) == (65, 4, "dummy")
    dflash = engines.parse_args(["run", "--engine", "sglang", "--mode", "dflash", "--out", "x"])
    kw = sglang_kwargs(engines.engine_spec(dflash, "t", "d"))
    assert kw["speculative_algorithm"] == "DFLASH" and "speculative_eagle_topk" not in kw
    # the drafter's backend apart from the target's (fa3 drafter, flashinfer tree verify)
    fa3 = engines.parse_args(["round-cost", "--engine", "sglang", "--mode", "tree",
                              "--draft-attention-backend", "fa3", "--out", "x"])
    kw = sglang_kwargs(engines.engine_spec(fa3, "t", "d", max_seqs=1))
    assert (kw["attention_backend"], kw["speculative_draft_attention_backend"]) == (
        "flashinfer", "fa3")
    # fa3 everywhere (its top-K > 1 cascade verifies the tree)
    both = engines.parse_args(["round-cost", "--engine", "sglang", "--mode", "tree",
                               "--attention-backend", "fa3", "--out", "x"])
    kw = sglang_kwargs(engines.engine_spec(both, "t", "d", max_seqs=1))
    assert (kw["attention_backend"], kw["speculative_draft_attention_backend"],
            kw["speculative_eagle_topk"]) == ("fa3", "fa3", 4)


def test_engines_tree_mode_refused_for_vllm(scripts):  # noqa: F811
    from bench.engine_rows import EngineSpec, vllm_kwargs

    engines = scripts[0]
    args = engines.parse_args(["run", "--engine", "vllm", "--mode", "tree", "--out", "x"])
    with pytest.raises(SystemExit, match="--mode tree needs --engine sglang"):
        engines.engine_spec(args, "t", "d")
    with pytest.raises(ValueError, match="vLLM has no hook for tree verification"):
        vllm_kwargs(EngineSpec(engine="vllm", target="t", draft="d", tree_topk=4))


def _engine_doc(mode, rows, **kw):
    return {"kind": "engine-run", "engine": "sglang", "engine_version": "0.5.16", "mode": mode,
            "tp": 1, "dtype": "bfloat16", "num_spec_tokens": 15, "device": "H200",
            "num_prompts": 2, "max_tokens": 3, "startup_s": 1.0, "cold_first_request_s": 0.1,
            "date": "2026-12-01", "complete": True, **kw,
            "rows": [{"temperature": 0.0, "concurrency": 1, "tokens_per_s": tps, "tau": tau,
                      "output_token_ids": ids} for tps, tau, ids in rows]}


def test_engine_report_puts_budgets_side_by_side(scripts):  # noqa: F811
    from bench.engine_report import mode_label, render_tables

    plain = _engine_doc("plain", [(100.0, None, [[1, 2, 3], [4, 5, 6]])])
    dflash = _engine_doc("dflash", [(200.0, 4.0, [[1, 2, 3], [4, 5, 6]])])
    tree = _engine_doc("tree", [(150.0, 6.0, [[1, 2, 9], [4, 5, 6]])], num_spec_tokens=32,
                       tree_topk=4)
    assert [mode_label(d) for d in (plain, dflash, tree)] == ["plain", "dflash", "tree32-k4"]
    rows = [line for line in render_tables([plain, dflash, tree]).splitlines()
            if line.startswith("| sglang |")]
    cells = [[c.strip() for c in r.split("|")[1:-1]] for r in rows]
    assert [(c[2], c[6], c[7], c[8], c[10]) for c in cells] == [
        ("dflash", "200.0", "2.00", "4.00", "2 / 2"), ("tree32-k4", "150.0", "1.50", "6.00",
                                                       "1 / 2")]
    cost = [dict(d, kind="round-cost", shape="qwen3-8b", per_round_s=s, tokens_per_round=t)
            for d, s, t in ((plain, 0.005, None), (dflash, 0.0065, 1.0), (tree, 0.008, 1.0))]
    table = render_tables(cost).split("| engine | TP | shape |")[1]
    assert "| tree32-k4 | 5.00 | 8.00 | 1.60 | 1.00 |" in table
    assert "| dflash | 5.00 | 6.50 | 1.30 | 1.00 |" in table


class FakeClock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeRunner:
    """A stand-in for an engine runner (no engine runs in this test): one request of n new
    tokens takes a 5 ms prefill (its first token) plus 2 ms per round of `tau` tokens, on
    `clock`; SGLang-style verify-round counts on each finished request."""

    def __init__(self, clock: FakeClock, tau: int | None):
        self.clock, self.tau, self.calls, self.batches = clock, tau, [], []

    def counters(self) -> dict:
        return {}

    def run(self, prompts, samplings, concurrency):
        from bench.engine_rows import Done

        n = samplings[0].max_tokens
        rounds = -(-(n - 1) // (self.tau or 1))
        self.clock.t += 0.005 + 0.002 * rounds  # the requests decode together, in step
        self.calls.append(n)
        self.batches.append((len(prompts), len(samplings), concurrency))
        return [Done(token_ids=[7] * n, latency_s=0.0,
                     verify_rounds=(rounds or None) if self.tau else None)
                for _ in prompts]


@pytest.mark.parametrize("tau", [None, 1, 3])
def test_round_cost_divides_the_decode_time_by_the_rounds(scripts, monkeypatch, tau):  # noqa: F811
    from bench import round_cost as rc

    clock = FakeClock()
    monkeypatch.setattr(rc.time, "perf_counter", clock)
    runner = FakeRunner(clock, tau)
    out = rc.round_cost(runner, [1, 2, 3], decode_tokens=64, repeats=3,
                        speculative=tau is not None)
    assert runner.calls == [1, 64, 1, 64] + [1, 64] * 3  # warm-up, then (1, n) per repeat
    assert out["per_round_s"] == pytest.approx(0.002)
    assert out["tokens_per_round"] == pytest.approx(63 / -(-63 // (tau or 1)))
    assert len(out["repeats_detail"]) == 3 and rc.median([None, 2, 1, 3]) == 2
    assert set(runner.batches) == {(1, 1, 1)}


@pytest.mark.parametrize("tau", [None, 3])
def test_round_cost_at_a_batch_divides_by_the_rounds_of_one_request(scripts, monkeypatch, tau):  # noqa: F811
    """--batch 4: four copies of the prompt sent together; the engine's rounds are summed over
    the requests, so a round's time is the decode time over the rounds of one request."""
    from bench import round_cost as rc

    clock = FakeClock()
    monkeypatch.setattr(rc.time, "perf_counter", clock)
    runner = FakeRunner(clock, tau)
    out = rc.round_cost(runner, [1, 2, 3], decode_tokens=64, repeats=3,
                        speculative=tau is not None, batch=4)
    assert set(runner.batches) == {(4, 4, 4)}
    assert out["per_round_s"] == pytest.approx(0.002)
    assert out["tokens_per_round"] == pytest.approx(63 / -(-63 // (tau or 1)))
    with pytest.raises(ValueError, match="batch"):
        rc.round_cost(runner, [1], decode_tokens=8, repeats=1, speculative=False, batch=0)
