"""`benchmarks/stack_sampler` + `stack_report.py` (CPU): a child process with the sampler on its
PYTHONPATH, busy in Python for 30 ms then asleep 10 ms, twenty times under one label, is
charged about 75 % to the busy function (the GIL would otherwise hide it: counting samples
gave 29 %), nothing is sampled without a label, and the call tree starts at the focus frame."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import os, time
def busy(t):
    end = time.perf_counter() + t
    while time.perf_counter() < end:
        pass
def loop():
    for _ in range(20):
        busy(0.03)
        time.sleep(0.01)
d = os.environ["STACK_SAMPLE_DIR"]
busy(0.2)  # no label yet: not sampled
open(os.path.join(d, "label"), "w").write("c1")
loop()
os.remove(os.path.join(d, "label"))
time.sleep(0.3)  # the sampler writes the finished label out
"""


def test_sampler_charges_wall_time_to_the_busy_frame(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from stack_report import report

    env = dict(os.environ, STACK_SAMPLE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT / "benchmarks" / "stack_sampler"))
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60)
    doc = report(tmp_path, "<string>:loop", 0.01, 4, 5)
    assert list(doc) == ["c1"]
    d = doc["c1"]
    assert 0.6 < d["seconds"] < 1.5  # 20 x 40 ms, the unlabelled 200 ms not counted
    tree = {r["frame"]: r for r in d["tree"]}
    assert tree["<string>:loop"]["share"] == 1.0 and tree["<string>:loop"]["depth"] == 0
    assert 0.65 < tree["<string>:busy"]["share"] < 0.88, tree  # 0.75; 0.60 unswitched
    assert tree["<string>:busy"]["depth"] == 1


def test_breakdown_of_the_committed_h200_profile(monkeypatch):
    """`gpu_adaptive_sglang.py breakdown` on the committed samples (stacks.tgz, 2026-12-03): the
    numbers BENCHMARKS.md quotes, every part inside the loop, the loop inside the wall time, and
    the append only where DFLASH runs."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench.sglang_steps import PARTS, breakdown

    doc = breakdown(ROOT / "benchmarks" / "results" / "gpu-adaptive-sglang-profile")
    assert set(doc) == {"plain", "adaptive-q1", "dflash"}
    for cells in doc.values():
        assert set(cells) == {"c1", "c16", "c64"}
        for cell in cells.values():
            assert set(cell) == {"wall", *PARTS}
            assert cell["loop"] <= cell["wall"] * 1.01
            assert all(cell[p] <= cell["loop"] + 1e-9 for p in PARTS)
    q1, plain = doc["adaptive-q1"]["c1"], doc["plain"]["c1"]
    assert (round(q1["wall"], 2), round(plain["wall"], 2)) == (3.33, 1.28)
    assert round(q1["drafter-KV append"], 2) == 0.52 and plain["drafter-KV append"] == 0
    assert round(q1["verify inputs (prepare_for_verify)"], 2) == 0.41
