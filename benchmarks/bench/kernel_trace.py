"""Where a round's GPU time goes, kernel by kernel: SGLang's own torch-profiler trace of a few
decode rounds (`record`), summed per kernel name (`kernel_table`, CPU, any chrome trace).

`round-cost --kernel-trace DIR` (gpu_engines.py, SGLang) records one request after its timed
repeats; the table per round goes into its JSON with the `timeline` (GPU busy and idle time,
and which Python code waited for the GPU), the traces (`*.trace.json.gz`) stay in DIR.
"""

from __future__ import annotations

import bisect
import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def refusal(engine: str, steps: int, tokens: int) -> str | None:
    """Why a kernel trace of `steps` decode steps of a `tokens`-token request cannot be
    recorded on `engine` (None: it can); checked before any engine starts."""
    if engine != "sglang":
        return "--kernel-trace records through SGLang's profiler: --engine sglang"
    if not 1 <= steps < tokens - 1:
        return f"--trace-steps must be in [1, {tokens - 2}] (--decode-tokens - 2), got {steps}"
    return None


def record(runner, ids: list[int], tokens: int, steps: int, out_dir: Path,
           batch: int = 1) -> Path:
    """`batch` greedy requests of `tokens` new tokens (copies of one prompt, sent together) on
    a started SGLang runner, the first `steps` decode steps (speculative rounds) under SGLang's
    profiler by stage (CPU and GPU activity; the prefills go to a file of their own); returns
    the decode trace written in `out_dir`."""
    from bench.engine_rows import Sampling

    if why := refusal("sglang", steps, tokens):
        raise ValueError(why)
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("*.trace.json.gz"))
    runner.engine.start_profile(output_dir=str(out_dir), activities=["CPU", "GPU"],
                                profile_by_stage=True, num_steps=steps)
    runner.run([ids] * batch, [Sampling(0.0, tokens, None)] * batch, batch)
    for _ in range(600):  # the scheduler writes the file after the request's steps
        new = sorted(p for p in set(out_dir.glob("*.trace.json.gz")) - before
                     if "DECODE" in p.name)
        if new:
            return new[-1]
        time.sleep(0.1)
    raise FileNotFoundError(f"SGLang's profiler wrote no decode trace in {out_dir}")


def per_kernel(runner, ids: list[int], tokens: int, steps: int, out_dir: Path,
               batch: int = 1) -> dict:
    """`record`, then its `kernel_table` and `timeline` with the trace's path."""
    trace = record(runner, ids, tokens, steps, out_dir, batch)
    events = load_events(trace)
    return dict(kernel_table(events, steps, top=40), **timeline(events, steps), trace=str(trace))


def load_events(path: Path) -> list[dict]:
    """The `traceEvents` of a chrome trace (`.json` or `.json.gz`)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def kernel_table(events: list[dict], rounds: int, top: int = 25) -> dict:
    """GPU time per round by kernel name: {"rounds", "gpu_us_per_round", "kernels": [{name,
    calls_per_round, us_per_round, share}], "other_us_per_round"} (the `top` longest by
    total; the rest summed in other)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    total, calls = defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES:
            total[e.get("name", "?")] += float(e.get("dur", 0.0))  # us
            calls[e.get("name", "?")] += 1
    gpu = sum(total.values())
    names = sorted(total, key=total.get, reverse=True)
    rows = [{"name": n, "calls_per_round": calls[n] / rounds, "us_per_round": total[n] / rounds,
             "share": total[n] / gpu} for n in names[:top]]
    return {"rounds": rounds, "gpu_us_per_round": gpu / rounds, "kernels": rows,
            "other_us_per_round": sum(total[n] for n in names[top:]) / rounds}


def _cut(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def markdown(table: dict, width: int = 70, rows: int = 25) -> str:
    """The table as markdown (its first `rows` kernels, names cut to `width` characters), and
    the host's waits for the GPU when the table has a `timeline`."""
    lines = [f"GPU {table['gpu_us_per_round']:.1f} us per round over {table['rounds']} rounds",
             "", "| kernel | calls / round | us / round | share |", "|---|---|---|---|"]
    for r in table["kernels"][:rows]:
        lines.append(f"| `{_cut(r['name'], width)}` | {r['calls_per_round']:.1f} | "
                     f"{r['us_per_round']:.1f} | {100 * r['share']:.1f} % |")
    rest = table["other_us_per_round"] + sum(r["us_per_round"] for r in table["kernels"][rows:])
    lines.append(f"| (the rest) | | {rest:.1f} | |")
    if "host_waits" in table:
        lines += ["", f"GPU busy {table['gpu_busy_us_per_round']:.1f} us, idle "
                  f"{table['gpu_idle_us_per_round']:.1f} us per round; the host waited for the "
                  f"GPU {table['host_wait_us_per_round']:.1f} us per round:", "",
                  "| call | where (innermost Python frames) | calls / round | us / round |",
                  "|---|---|---|---|"]
        for w in table["host_waits"]:
            lines.append(f"| `{w['call']}` | `{_cut(w['where'], 2 * width)}` | "
                         f"{w['calls_per_round']:.1f} | {w['us_per_round']:.1f} |")
    return "\n".join(lines)


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _enclosing(frames: list[dict], starts: list[float], e: dict, depth: int) -> list[str]:
    """The innermost `depth` frames (sorted by start) that contain event `e`, innermost first:
    scanning back from `e`'s start, the first containing frame is the innermost."""
    out, end = [], e["ts"] + e.get("dur", 0.0)
    for i in range(bisect.bisect_right(starts, e["ts"]) - 1, -1, -1):
        f = frames[i]
        if f["ts"] + f.get("dur", 0.0) >= end:
            out.append(f["name"])
            if len(out) == depth:
                break
    return out


def timeline(events: list[dict], rounds: int, min_us: float = 20.0, depth: int = 4,
             top: int = 12) -> dict:
    """Per round: GPU busy time (the union of its kernels, copies and sets), GPU idle time
    (the trace's GPU span minus busy), and where the host waited for the GPU: CUDA runtime
    calls that block (`*Synchronize*`, and `*Memcpy*` calls of at least `min_us`, e.g. a copy
    to the host), grouped by the innermost `depth` Python frames around them (the profiler's
    `python_function` events of the same thread; SGLang records them, `with_stack`); the `top`
    longest groups."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
           if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    busy = _busy(gpu)
    span = max(b for _, b in gpu) - min(a for a, _ in gpu) if gpu else 0.0
    frames: dict = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "python_function":
            frames[(e.get("pid"), e.get("tid"))].append(e)
    for fs in frames.values():
        fs.sort(key=lambda f: f["ts"])
    starts = {k: [f["ts"] for f in fs] for k, fs in frames.items()}
    total, calls = defaultdict(float), defaultdict(int)
    for e in events:
        name, dur = e.get("name", ""), float(e.get("dur", 0.0))
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        if not ("Synchronize" in name or ("Memcpy" in name and dur >= min_us)):
            continue
        key = (e.get("pid"), e.get("tid"))
        where = " < ".join(_enclosing(frames.get(key, []), starts.get(key, []), e, depth))
        total[(name, where)] += dur
        calls[(name, where)] += 1
    keys = sorted(total, key=total.get, reverse=True)
    return {"gpu_busy_us_per_round": busy / rounds,
            "gpu_idle_us_per_round": (span - busy) / rounds,
            "host_wait_us_per_round": sum(total.values()) / rounds,
            "host_waits": [{"call": k[0], "where": k[1] or "?",
                            "calls_per_round": calls[k] / rounds,
                            "us_per_round": total[k] / rounds} for k in keys[:top]]}
