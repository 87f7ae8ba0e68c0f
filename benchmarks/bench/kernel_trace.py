"""Where a round's GPU time goes, kernel by kernel: SGLang's own torch-profiler trace of a few
decode rounds (`record`), summed per kernel name (`kernel_table`, CPU, any chrome trace).

`round-cost --kernel-trace DIR` (gpu_engines.py, SGLang) records one request after its timed
repeats; the table per round goes into its JSON, the traces (`*.trace.json.gz`) stay in DIR.
"""

from __future__ import annotations

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


def record(runner, ids: list[int], tokens: int, steps: int, out_dir: Path) -> Path:
    """One greedy request of `tokens` new tokens on a started SGLang runner, its first `steps`
    decode steps (speculative rounds) under SGLang's profiler by stage (CPU and GPU activity;
    the prefill goes to a file of its own); returns the decode trace written in `out_dir`."""
    from bench.engine_rows import Sampling

    if why := refusal("sglang", steps, tokens):
        raise ValueError(why)
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(out_dir.glob("*.trace.json.gz"))
    runner.engine.start_profile(output_dir=str(out_dir), activities=["CPU", "GPU"],
                                profile_by_stage=True, num_steps=steps)
    runner.run([ids], [Sampling(0.0, tokens, None)], 1)
    for _ in range(600):  # the scheduler writes the file after the request's steps
        new = sorted(p for p in set(out_dir.glob("*.trace.json.gz")) - before
                     if "DECODE" in p.name)
        if new:
            return new[-1]
        time.sleep(0.1)
    raise FileNotFoundError(f"SGLang's profiler wrote no decode trace in {out_dir}")


def per_kernel(runner, ids: list[int], tokens: int, steps: int, out_dir: Path) -> dict:
    """`record`, then its `kernel_table` with the trace's path."""
    trace = record(runner, ids, tokens, steps, out_dir)
    return dict(kernel_table(load_events(trace), steps), trace=str(trace))


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


def markdown(table: dict, width: int = 70) -> str:
    """The table as markdown (names cut to `width` characters)."""
    lines = [f"GPU {table['gpu_us_per_round']:.1f} us per round over {table['rounds']} rounds",
             "", "| kernel | calls / round | us / round | share |", "|---|---|---|---|"]
    for r in table["kernels"]:
        name = r["name"] if len(r["name"]) <= width else r["name"][: width - 3] + "..."
        lines.append(f"| `{name}` | {r['calls_per_round']:.1f} | {r['us_per_round']:.1f} | "
                     f"{100 * r['share']:.1f} % |")
    lines.append(f"| (the rest) | | {table['other_us_per_round']:.1f} | |")
    return "\n".join(lines)
