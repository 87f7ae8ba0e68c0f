"""`benchmarks/decode_prep_bench.py` in the oldest-SGLang env on CPU (a short run): both sides
timed at every batch size, the JSON written; its refusals."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.oldest_sglang import LEGACY_ENV

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "decode_prep_bench.py"


def run(*args, tmp_path):
    if not (LEGACY_ENV / "sglang").is_dir():
        pytest.skip(f"oldest-SGLang env missing ({LEGACY_ENV}): `make setup` installs it")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(LEGACY_ENV)]))
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_short_run_writes_both_sides(tmp_path):
    out = tmp_path / "dp.json"
    proc = run("--device", "cpu", "--batch", "1", "8", "--steps", "5", "--blocks", "1",
               "--out", str(out), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["kind"] == "decode-prep-bench" and doc["device"] == "cpu" and doc["w"] == 16
    assert [r["batch"] for r in doc["rows"]] == [1, 8]
    for r in doc["rows"]:
        for k in ("dflash_cold_us", "dflash_warm_us", "ours_cold_us", "ours_warm_us"):
            assert r[k] > 0, k
        assert r["warm_ratio"] == pytest.approx(r["ours_warm_us"] / r["dflash_warm_us"])


def test_refuses_an_empty_batch(tmp_path):
    proc = run("--device", "cpu", "--batch", "0", tmp_path=tmp_path)
    assert proc.returncode == 2 and "--batch must be >= 1" in proc.stderr
