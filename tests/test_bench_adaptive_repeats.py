"""`benchmarks/gpu_adaptive_sglang.py --repeats R` and `--starts S` without an engine: the median
row of R runs per concurrency, the range beside it in the report, S servers' results merged into
the median start's rows, and a bad R or S refused before any engine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_script import BENCH, load, on_bench_path

FIX = Path(__file__).resolve().parents[1] / "examples" / "fixtures"


@pytest.fixture(scope="module")
def script():
    with on_bench_path():
        yield load("gpu_adaptive_sglang")


def test_median_cells_pick_each_concurrency_s_middle_run(script):
    from dflash_plugin.tune import Cell

    runs = [[Cell(0, 1, 100.0), Cell(0, 16, 1900.0)],
            [Cell(0, 1, 90.0), Cell(0, 16, 2000.0)],
            [Cell(0, 1, 110.0), Cell(0, 16, 1950.0)]]
    got = script.median_cells(runs)
    assert [(c.concurrency, c.tokens_per_s) for c in got] == [(1, 100.0), (16, 1950.0)]
    two = script.median_cells(runs[:2])  # the lower of two middles
    assert [c.tokens_per_s for c in two] == [90.0, 1900.0]
    assert script.median_cells(runs[:1]) == runs[0]


def test_report_gives_median_ratio_and_range(script, tmp_path, capsys):
    def doc(mode, repeats):
        med = [sorted(r[i] for r in repeats)[(len(repeats) - 1) // 2] for i in range(2)]
        return {"mode": mode, "repeats": repeats, "outputs": [[1, 2], [3]],
                "cells": [{"k": 0, "concurrency": c, "tokens_per_s": t}
                          for c, t in zip((1, 16), med)]}
    (tmp_path / "plain.json").write_text(json.dumps(doc("plain", [[150, 1900], [152, 1960],
                                                                  [151, 1930]])))
    (tmp_path / "adaptive.json").write_text(json.dumps(doc("adaptive", [[148, 1890]])))
    script.report(tmp_path)
    out = capsys.readouterr().out
    assert "| 1 | 151 (150-152) | 148 | 0.980 |" in out
    assert "| 16 | 1930 (1900-1960) | 1890 | 0.979 |" in out
    assert "adaptive vs plain: {'identical': 2, 'total': 2, 'first_diff': []}" in out


def test_bad_repeats_is_refused_before_any_engine(tmp_path):
    out = tmp_path / "never-made"
    got = subprocess.run([sys.executable, str(BENCH / "gpu_adaptive_sglang.py"), "all",
                          "--out", str(out), "--repeats", "0"], capture_output=True, text=True)
    assert got.returncode == 2 and "--repeats must be >= 1, got 0" in got.stderr
    assert not out.exists()


def test_merge_starts_takes_the_median_start_and_every_run(script, tmp_path, capsys):
    def doc(mode, repeats, outputs, start_s):
        med = [sorted(r[i] for r in repeats)[(len(repeats) - 1) // 2] for i in range(2)]
        return {"mode": mode, "start_s": start_s, "repeats": repeats, "outputs": outputs,
                "cells": [{"k": 0, "concurrency": c, "tokens_per_s": t}
                          for c, t in zip((16, 64), med)]}
    runs = {1: ([[10000, 28000], [10400, 28500]], 30.0), 2: ([[12000, 20000]], 31.0),
            3: ([[9000, 26000]], 29.0)}
    for s, (reps, t) in runs.items():
        (tmp_path / f"start-{s}").mkdir()
        (tmp_path / f"start-{s}" / "dflash.json").write_text(
            json.dumps(doc("dflash", reps, [[1, 2]], t)))
    (tmp_path / "start-4").mkdir()
    (tmp_path / "start-4" / "dflash.error").write_text("exit 1\n")
    (tmp_path / "start-1" / "adaptive.json").write_text(
        json.dumps(doc("adaptive", [[11000, 27000]], [[1, 2]], 40.0)))
    (tmp_path / "start-2" / "adaptive.json").write_text(
        json.dumps(doc("adaptive", [[11500, 26000]], [[1, 3]], 41.0)))
    script.merge_starts(tmp_path, ["dflash", "adaptive", "plain"], 4)
    d = json.loads((tmp_path / "dflash.json").read_text())
    # per concurrency the median of the starts' rows (10000 / 12000 / 9000; 28000 / 20000 / 26000)
    assert [c["tokens_per_s"] for c in d["cells"]] == [10000, 26000]
    assert d["repeats"] == [[10000, 28000], [10400, 28500], [12000, 20000], [9000, 26000]]
    assert [x["start_s"] for x in d["starts"]] == [30.0, 31.0, 29.0]
    assert d["outputs_agree"] and d["starts_failed"] == 1
    a = json.loads((tmp_path / "adaptive.json").read_text())
    assert [c["tokens_per_s"] for c in a["cells"]] == [11000, 26000]  # lower of two middles
    assert not a["outputs_agree"] and a["starts_failed"] == 2
    assert not (tmp_path / "plain.json").exists()  # no start of it ran
    script.report(tmp_path)
    out = capsys.readouterr().out
    assert "| 16 | 10000 (9000-12000) | 11000 (11000-11500) | 1.100 |" in out
    assert "| 64 | 26000 (20000-28500) | 26000 (26000-27000) | 1.000 |" in out
    assert "adaptive: 2 server starts (2 failed), greedy outputs alike in all: False" in out


@pytest.mark.parametrize("args, message", [
    (["all", "--starts", "0"], "--starts must be >= 1, got 0"),
    (["all", "--starts", "2", "--trace", "1x16"], "--starts > 1 needs `all` and no --trace"),
    (["profile", "--starts", "2"], "--starts > 1 needs `all` and no --trace"),
    (["all", "--length-spread", "1"], "--length-spread must be in [0, 1), got 1.0"),
    (["run", "--mode", "plain", "--length-spread", "-0.1"],
     "--length-spread must be in [0, 1), got -0.1"),
    (["all", "--context-length", "1024"], "--context-length must be >= 2048"),
])
def test_bad_starts_is_refused_before_any_engine(tmp_path, args, message):
    out = tmp_path / "never-made"
    got = subprocess.run([sys.executable, str(BENCH / "gpu_adaptive_sglang.py"), *args,
                          "--out", str(out)], capture_output=True, text=True)
    assert got.returncode == 2 and message in got.stderr
    assert not out.exists()


def test_all_with_starts_runs_the_modes_in_turn_into_start_folders(script, tmp_path,
                                                                   monkeypatch, capsys):
    """`all --starts 2`: plain, adaptive, plain, adaptive, each child told its `start-N`
    folder and one start (a stand-in for the child: it writes the results file a real one
    would), then the merged files and the report."""
    calls = []

    def last(cmd, flag):  # argparse keeps a repeated flag's last value
        return cmd[len(cmd) - cmd[::-1].index(flag)]

    def child(cmd, env):
        mode, out = last(cmd, "--mode"), Path(last(cmd, "--out"))
        assert last(cmd, "--starts") == "1" and cmd[2] == "run"
        calls.append((mode, out.name))
        tps = 100.0 * len(calls)
        out.joinpath(f"{mode}.json").write_text(json.dumps({
            "mode": mode, "start_s": 1.0, "repeats": [[tps]], "outputs": [[1]],
            "cells": [{"k": 0, "concurrency": 4, "tokens_per_s": tps}]}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(script.subprocess, "run", child)
    monkeypatch.setattr(sys, "argv", ["gpu_adaptive_sglang.py", "all", "--out", str(tmp_path),
                                      "--modes", "plain,adaptive", "--starts", "2",
                                      "--concurrency", "4"])
    script.main()
    assert calls == [("plain", "start-1"), ("adaptive", "start-1"), ("plain", "start-2"),
                     ("adaptive", "start-2")]
    out = capsys.readouterr().out
    assert "| 4 | 100 (100-300) | 200 (200-400) | 2.000 |" in out


def test_run_mode_records_the_host_per_row(script, monkeypatch):
    """`run_mode` with the engine and its rows as stand-ins (MOCKS: SGLang's engine needs a
    GPU; the rows log as `measure_engine` does): the staggered lengths reach the rows, the
    repeats their median, and the host record has a snapshot before and after and one interval
    per logged row."""
    import argparse
    import types

    from dflash_plugin.engines import sglang_tune
    from dflash_plugin.tune import Cell, Finished

    seen = {}
    monkeypatch.setattr(script, "start", lambda args, mode: types.SimpleNamespace(
        shutdown=lambda: seen.setdefault("shutdown", True)))
    monkeypatch.setattr("dflash_plugin.engines.vllm_tune.prompt_ids",
                        lambda target, prompts, keep: [[1, 2, 3]] * 20)

    def rows(engine, k, ids, concurrencies, *, spread, log, **kw):
        seen["spread"] = spread
        out = []
        for c in concurrencies:
            log(f"sglang k={k} c={c}: 1.0 tok/s")
            out.append(Cell(k, c, 100.0 * c + len(seen.setdefault("runs", []))))
        seen["runs"].append(out)
        return out

    monkeypatch.setattr(sglang_tune, "measure_engine", rows)
    monkeypatch.setattr(sglang_tune, "closed_loop",
                        lambda engine, ids, n, c: [Finished([7], 0.1, None, None)] * len(ids))
    args = argparse.Namespace(
        max_new_tokens=128, target=FIX / "code-target", prompts=FIX / "dev-prompts.jsonl",
        prompt_tokens=None, temperature=0.0, length_spread=0.5, waves=2, min_requests=4,
        min_seconds=0.0, repeats=3, concurrency=[1, 4], trace=None, config=None)
    doc = script.run_mode(args, "plain")
    assert seen["spread"] == 0.5 and seen["shutdown"] and doc["length_spread"] == 0.5
    assert [c["tokens_per_s"] for c in doc["cells"]] == [101.0, 401.0]  # the median repeat
    host = doc["host"]
    assert host["before_rows"]["procs"] and host["after_rows"]["procs"]
    assert [r["row"] for r in host["rows"]] == ["sglang k=0 c=1: 1.0 tok/s",
                                                "sglang k=0 c=4: 1.0 tok/s"] * 3
    assert all(r["wall_s"] >= 0 for r in host["rows"])


@pytest.mark.parametrize("mode", ["plain", "adaptive"])
def test_start_passes_the_context_length_to_every_server(script, monkeypatch, mode):
    """`--context-length` reaches SGLang's engine as its context length (which also caps the
    prefill CUDA graphs), in every mode. MOCK: the engine start (needs a GPU) records its
    arguments."""
    import argparse

    from dflash_plugin.engines import sglang_tune

    seen = {}
    monkeypatch.setattr(sglang_tune, "start", lambda *a, **kw: seen.update(kw))
    args = argparse.Namespace(load_format=None, config=FIX / "none.json", draft=FIX / "d",
                              target=FIX / "t", log_level=None, concurrency=[1, 32],
                              dtype="bfloat16", context_length=4096, out=FIX)
    script.start(args, mode)
    assert seen["max_model_len"] == 4096 and seen["max_running_requests"] == 32
