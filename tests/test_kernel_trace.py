"""`benchmarks/bench/kernel_trace.py` without an engine: GPU time per round summed by kernel
name from a chrome trace (hand-made events; a real torch-profiler export read back, CPU), and
`round-cost --kernel-trace` refusing what it cannot do before any engine starts."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def kt():
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        from bench import kernel_trace

        yield kernel_trace
    finally:
        sys.path[:] = saved


def ev(name, dur, cat="kernel", ph="X"):
    return {"name": name, "dur": dur, "cat": cat, "ph": ph, "ts": 0}


def test_kernel_table_sums_gpu_events_per_round(kt):
    events = [ev("gemm", 100.0), ev("gemm", 60.0), ev("attn", 40.0), ev("Memcpy HtoD", 10.0,
              "gpu_memcpy"), ev("gemm", 999.0, "cpu_op"), ev("attn", 5.0, ph="i"), ev("tiny", 2.0)]
    t = kt.kernel_table(events, rounds=2, top=2)
    assert t["gpu_us_per_round"] == pytest.approx((160 + 40 + 10 + 2) / 2)
    assert [r["name"] for r in t["kernels"]] == ["gemm", "attn"]
    gemm = t["kernels"][0]
    assert gemm["calls_per_round"] == 1.0 and gemm["us_per_round"] == 80.0
    assert gemm["share"] == pytest.approx(160 / 212)
    assert t["other_us_per_round"] == pytest.approx(6.0)  # memcpy + tiny, not the cpu_op
    md = kt.markdown(t, width=4)
    assert "| `gemm` | 1.0 | 80.0 | 75.5 % |" in md and "| `a...` |" not in md
    assert "106.0 us per round over 2 rounds" in md
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        kt.kernel_table(events, rounds=0)


def test_load_events_reads_a_torch_profiler_export(kt, tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    path = tmp_path / "x.trace.json.gz"
    prof.export_chrome_trace(str(path))
    events = kt.load_events(path)
    assert any("mm" in e.get("name", "") for e in events)
    assert kt.kernel_table(events, rounds=1)["gpu_us_per_round"] == 0.0  # CPU ops only
    assert kt.timeline(events, rounds=1)["host_waits"] == []  # no CUDA runtime calls


def test_round_cost_kernel_trace_refuses_before_any_engine(tmp_path):
    import subprocess

    base = [sys.executable, str(BENCH / "gpu_engines.py"), "round-cost", "--mode", "tree",
            "--kernel-trace", str(tmp_path / "t"), "--out", str(tmp_path / "o.json")]
    vllm = subprocess.run(base + ["--engine", "vllm"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert vllm.returncode != 0 and "--engine sglang" in vllm.stderr
    steps = subprocess.run(base + ["--engine", "sglang", "--decode-tokens", "16",
                                   "--trace-steps", "20"], capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
    assert steps.returncode != 0 and "--trace-steps must be in [1, 14]" in steps.stderr
    assert not (tmp_path / "o.json").exists()


def frame(name, ts, dur, tid=1):
    return {"name": name, "cat": "python_function", "ph": "X", "ts": ts, "dur": dur, "pid": 0,
            "tid": tid}


def test_timeline_gpu_idle_and_who_waited(kt):
    """GPU busy is the union of its events (overlap counted once), idle the rest of its span;
    a blocking runtime call is charged to the innermost Python frames around it on its own
    thread (a frame that ended before it, or another thread's, does not count); short
    memcpys and non-blocking calls are not waits."""
    gpu = [dict(ev("k1", 100.0), ts=0), dict(ev("k2", 100.0), ts=50),  # busy 0-150
           dict(ev("copy", 10.0, "gpu_memcpy"), ts=400)]  # idle 150-400
    frames = [frame("scheduler.py(1): loop", 0, 1000), frame("worker.py(2): step", 10, 900),
              frame("flashinfer/prefill.py(3): plan", 200, 100),
              frame("worker.py(4): done_before", 150, 20),
              frame("other.py(5): elsewhere", 0, 1000, tid=2)]
    rt = [dict(ev("cudaStreamSynchronize", 80.0, "cuda_runtime"), ts=210, pid=0, tid=1),
          dict(ev("cudaMemcpyAsync", 30.0, "cuda_runtime"), ts=205, pid=0, tid=1),
          dict(ev("cudaMemcpyAsync", 5.0, "cuda_runtime"), ts=300, pid=0, tid=1),  # short
          dict(ev("cudaLaunchKernel", 90.0, "cuda_runtime"), ts=600, pid=0, tid=1),
          dict(ev("cudaStreamSynchronize", 40.0, "cuda_runtime"), ts=950, pid=0, tid=1)]
    t = kt.timeline(gpu + frames + rt, rounds=2, depth=2)
    assert t["gpu_busy_us_per_round"] == pytest.approx(160 / 2)
    assert t["gpu_idle_us_per_round"] == pytest.approx((410 - 160) / 2)
    assert t["host_wait_us_per_round"] == pytest.approx((80 + 30 + 40) / 2)
    w = {(x["call"], x["where"]): x for x in t["host_waits"]}
    plan = ("cudaStreamSynchronize", "flashinfer/prefill.py(3): plan < worker.py(2): step")
    assert list(w)[0] == plan and w[plan]["us_per_round"] == 40.0
    assert ("cudaMemcpyAsync", "flashinfer/prefill.py(3): plan < worker.py(2): step") in w
    assert w[("cudaStreamSynchronize", "scheduler.py(1): loop")]["calls_per_round"] == 0.5
    md = kt.markdown(dict(kt.kernel_table(gpu, 2), **t), rows=1)
    assert "idle 125.0 us per round" in md and "| `cudaStreamSynchronize` |" in md
    assert "| (the rest) | | 55.0 | |" in md  # k2 and the copy, past the first row
    assert kt.timeline([], 1)["gpu_idle_us_per_round"] == 0.0
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        kt.timeline(gpu, 0)
