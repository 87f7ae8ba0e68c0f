"""`benchmarks/gpu_adaptive_sglang.py --repeats R` without an engine: the median row of R runs
per concurrency, the range beside it in the report, and a bad R refused before any engine."""

import json
import subprocess
import sys

import pytest

from tests.bench_script import BENCH, load, on_bench_path


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
