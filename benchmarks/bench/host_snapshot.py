"""Where a benchmark's processes run on the host, for rows that move between server starts.

On the H100 hosts (16 cores) the fixture's SGLang rows moved by up to 70 % from one server start
to the next (BENCHMARKS.md, 2026-12-06 night): a 20M-parameter model is host-bound, so the
scheduler's core, its neighbours and the host's load may set the pace. `snapshot()` records, for
this process and every descendant (the engine's scheduler and detokenizer), the core it last ran
on, the cores it may run on, its threads and its CPU seconds so far, with the host's core counts,
load and clock and the GPU's clocks, power, temperature and use; two snapshots around the timed
rows give each process's CPU use over them (`cpu_use`)."""

from __future__ import annotations

import os
import subprocess


def cores(ids) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    out, ids = [], sorted(set(ids))
    for i in ids:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def tree(pid: int | None, read) -> list:
    """`read(process)` for `pid` (default this process) and each of its descendants, leaving
    out those that end meanwhile."""
    import psutil

    root = psutil.Process(pid or os.getpid())
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            with p.oneshot():
                out.append(read(p))
        except psutil.Error:  # ended meanwhile
            continue
    return out


def cpu_seconds(p) -> float:
    t = p.cpu_times()
    return t.user + t.system


def snapshot(pid: int | None = None) -> dict:
    """The host and `pid`'s process tree (default this process) now."""
    import psutil

    procs = tree(pid, lambda p: {
        "pid": p.pid, "name": p.name(), "core": p.cpu_num(), "affinity": cores(p.cpu_affinity()),
        "threads": p.num_threads(), "cpu_s": round(cpu_seconds(p), 3)})
    freq = psutil.cpu_freq()
    return {"cores": psutil.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "mhz": round(freq.current) if freq else None, "gpu": gpu_state(), "procs": procs}


GPU_FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu"


def gpu_state() -> str | None:
    """nvidia-smi's `GPU_FIELDS` of the first GPU now ("1980 MHz, 2619 MHz, 310.5 W, 45, 97 %"),
    or None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_FIELDS}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else None


def cpu_use(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """{'name pid': CPU seconds per wall second between two snapshots} for the processes in
    both (1.0: one core busy all the time)."""
    was = {p["pid"]: p["cpu_s"] for p in before["procs"]}
    return {f"{p['name']} {p['pid']}": round((p["cpu_s"] - was[p["pid"]]) / seconds, 3)
            for p in after["procs"] if p["pid"] in was and seconds > 0}


def counters(pid: int | None = None) -> dict:
    """Cheap counters for one row: the time, the host's CPU times (all cores, seconds) and the
    CPU seconds of each process of `pid`'s tree (default this process)."""
    import time

    import psutil

    from .gpu_busy import now_us, samples_since

    procs = dict(tree(pid, lambda p: (p.pid, cpu_seconds(p))))
    t_us = now_us()  # with the GPU's utilisation samples of the last 60 s (a row's: `interval`)
    return {"t": time.perf_counter(), "host": psutil.cpu_times()._asdict(), "procs": procs,
            "gpu_us": t_us, "gpu_samples": samples_since(t_us - 60_000_000)}


def interval(a: dict, b: dict) -> dict:
    """Between two `counters`: the wall seconds, the share of the host's CPU time busy and
    stolen by the hypervisor (a virtual machine's neighbours), the most cores any one
    process of the tree used (the scheduler: about 1.0, as it spins while it waits) and the
    GPU's mean busy share from the driver's samples (`gpu_busy`; None without them)."""
    from .gpu_busy import mean_busy

    total = sum(b["host"].values()) - sum(a["host"].values())
    d = {k: b["host"][k] - a["host"].get(k, 0.0) for k in b["host"]}
    wall = b["t"] - a["t"]
    idle = d.get("idle", 0.0) + d.get("iowait", 0.0)
    top = max((b["procs"][p] - a["procs"][p] for p in b["procs"] if p in a["procs"]),
              default=0.0)
    return {"wall_s": round(wall, 3),
            "busy": round(1 - idle / total, 3) if total > 0 else None,
            "steal": round(d.get("steal", 0.0) / total, 4) if total > 0 else None,
            "top_proc_cores": round(top / wall, 3) if wall > 0 else None,
            "gpu_busy": mean_busy(b.get("gpu_samples"), a.get("gpu_us", 0), b.get("gpu_us", 0))}


def host_line(host: dict | None) -> str:
    """One line from `run_mode`'s host record: the load and clock after the rows and each busy
    process (over 5 % of a core): its name, last core, allowed cores, cores used."""
    if not host or "after_rows" not in host:
        return "no host record"
    after, use = host["after_rows"], host.get("cpu_use", {})
    busy = [f"{p['name']} on {p['core']} of {p['affinity']}: {use[k]:.2f}"
            for p in after["procs"] if use.get(k := f"{p['name']} {p['pid']}", 0) > 0.05]
    gpu = f"GPU {after['gpu']}; " if after.get("gpu") else ""
    rows = [r for r in host.get("rows", []) if r.get("steal") is not None]
    gpu_rows = [r["gpu_busy"] for r in rows if r.get("gpu_busy") is not None]
    per_row = (f"rows: steal up to {max(r['steal'] for r in rows):.1%}, busiest process "
               f"{min(r['top_proc_cores'] for r in rows):.2f}-"
               f"{max(r['top_proc_cores'] for r in rows):.2f} cores"
               + (f", GPU busy {min(gpu_rows):.0%}-{max(gpu_rows):.0%}" if gpu_rows else "")
               + "; ") if rows else ""
    return f"load {after['loadavg'][0]}, {after['mhz']} MHz; {gpu}{per_row}" + "; ".join(busy)
