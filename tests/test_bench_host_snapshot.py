"""`benchmarks/bench/host_snapshot.py`: the cores and CPU time of a process tree, read from this
test's own process and a busy child (real processes, no engine)."""

import subprocess
import sys
import time

from tests.bench_script import on_bench_path


def test_snapshot_sees_a_child_and_its_cpu_use():
    with on_bench_path():
        from bench.host_snapshot import cores, cpu_use, host_line, snapshot

    assert cores([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and cores([3]) == "3"
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                              "while time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)
        before, t0 = snapshot(), time.perf_counter()
        time.sleep(0.7)
        after = snapshot()
        secs = time.perf_counter() - t0
    finally:
        child.kill()
        child.wait()
    pids = {p["pid"]: p for p in after["procs"]}
    assert child.pid in pids and after["cores"] >= 1 and len(after["loadavg"]) == 3
    p = pids[child.pid]
    assert p["core"] >= 0 and p["affinity"] and p["threads"] >= 1
    use = cpu_use(before, after, secs)
    assert use[f"{p['name']} {child.pid}"] > 0.5  # a spinning child: most of a core
    line = host_line({"after_rows": after, "cpu_use": use})
    assert f"{p['name']} on {p['core']} of {p['affinity']}" in line
    assert host_line(None) == "no host record"


def test_gpu_state_without_nvidia_smi(monkeypatch):
    """No nvidia-smi on the PATH (CI): None, and the line leaves the GPU out."""
    with on_bench_path():
        from bench import host_snapshot

    monkeypatch.setenv("PATH", "/nonexistent")
    assert host_snapshot.gpu_state() is None
    after = {"loadavg": [0.5, 0, 0], "mhz": 2000, "gpu": None, "procs": []}
    assert host_snapshot.host_line({"after_rows": after}) == "load 0.5, 2000 MHz; "


def test_row_counters_see_a_busy_child():
    """`counters` around a stretch with a spinning child: the interval's busiest process used
    most of a core and the host was partly busy; the report line carries the per-row range."""
    with on_bench_path():
        from bench.host_snapshot import counters, host_line, interval, snapshot

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                              "while time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)
        a = counters()
        time.sleep(0.7)
        b = counters()
        after = snapshot()
    finally:
        child.kill()
        child.wait()
    row = interval(a, b)
    assert 0.6 < row["wall_s"] < 2 and row["top_proc_cores"] > 0.5
    assert 0 < row["busy"] <= 1 and 0 <= row["steal"] < 1
    line = host_line({"after_rows": after, "cpu_use": {}, "rows": [dict(row="r", **row)]})
    assert "rows: steal up to" in line and "busiest process" in line


def test_gpu_busy_mean_and_no_driver(monkeypatch):
    """`gpu_busy`: a row's mean is over the samples stamped inside it only; without NVML (CI has
    no driver) the samples are None, the row's `gpu_busy` None and the line leaves it out."""
    with on_bench_path():
        from bench import gpu_busy
        from bench.host_snapshot import host_line, interval

    samples = [(100, 90), (200, 20), (300, 40), (400, 100)]
    assert gpu_busy.mean_busy(samples, 100, 300) == 0.3  # 20 % and 40 %, not the 90 % at 100
    assert gpu_busy.mean_busy(samples, 400, 500) is None and gpu_busy.mean_busy(None, 0, 9) is None
    monkeypatch.setitem(gpu_busy._NVML, "dev", None)  # as where libnvidia-ml.so.1 is absent
    assert gpu_busy.samples_since(gpu_busy.now_us()) is None
    host = {"user": 1.0, "idle": 1.0}
    a = {"t": 0.0, "host": host, "procs": {}, "gpu_us": 100, "gpu_samples": None}
    b = {"t": 1.0, "host": {"user": 2.0, "idle": 2.0}, "procs": {}, "gpu_us": 300,
         "gpu_samples": samples}
    assert interval(a, b)["gpu_busy"] == 0.3
    assert interval(a, dict(b, gpu_samples=None))["gpu_busy"] is None
    after = {"loadavg": [0.5, 0, 0], "mhz": 2000, "gpu": None, "procs": []}
    rows = [dict(row="r", **interval(a, b)), dict(row="s", **interval(a, dict(b, gpu_samples=[])))]
    assert "GPU busy 30%-30%; " in host_line({"after_rows": after, "rows": rows})
    rows = [dict(row="r", **interval(a, dict(b, gpu_samples=None)))]
    assert "GPU busy" not in host_line({"after_rows": after, "rows": rows})
