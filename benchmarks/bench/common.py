"""What the benchmark entry points share: repo paths and fixture defaults, prompt files, the run
record every results file carries (date, machine, device, versions, commit, command), JSON
writing and timing, and two helpers of the side-by-side scripts (`attempt`, `agreement`).

Entry points run as `python benchmarks/NAME.py`, so `benchmarks/` is on `sys.path` and they import
this module as `bench.common`; `checkout_first()` puts the repo root (and `benchmarks/`) before any
installed copy of the packages.
"""

from __future__ import annotations

import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "examples" / "fixtures"
DEV_PROMPTS = FIXTURES / "dev-prompts.jsonl"


def fixture(name: str) -> Path:
    """Path of a bundled fixture, e.g. fixture("code-dllm")."""
    return FIXTURES / name


def kernel_args(doc: str, add=None):
    """The arguments of the kernel benchmarks (--out, --device, --dry-run, --iters, and what
    `add(parser)` adds); on `--device cpu` Triton's interpreter is switched on, which must happen
    before anything imports triton."""
    import argparse
    import os

    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, few iterations")
    p.add_argument("--iters", type=int, default=200)
    if add is not None:
        add(p)
    args = p.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args


def checkout_first() -> None:
    """This checkout's packages (and `benchmarks/`, for `bench`) first on sys.path."""
    for p in (str(ROOT / "benchmarks"), str(ROOT)):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)


def read_prompts(path: str | Path = DEV_PROMPTS) -> list[str]:
    """The "prompt" field of every non-empty line of a JSONL file (the project's one reader,
    `dflash_plugin.training.data.load_prompts_jsonl`; a bad file exits with its message)."""
    from dflash_plugin.errors import ConfigError
    from dflash_plugin.training.data import load_prompts_jsonl

    try:
        return load_prompts_jsonl(path)
    except ConfigError as err:
        raise SystemExit(str(err)) from None


def span(text: str) -> slice:
    """"32:48" -> slice(32, 48): a range of prompt indices on the command line."""
    lo, _, hi = text.partition(":")
    return slice(int(lo) if lo else None, int(hi) if hi else None)


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_info(device=None) -> dict:
    """Where and how this run happened: UTC date, machine, accelerator, versions, commit,
    the command line."""
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.node(), "platform": platform.platform(),
            "python": platform.python_version(), "commit": _commit(),
            "command": shlex.join(["python", *sys.argv])}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            dev = torch.device(device) if device is not None else torch.device("cuda")
            if dev.type == "cuda":
                info["gpu"] = torch.cuda.get_device_name(dev)
                info["cuda"] = torch.version.cuda
    if device is not None:
        info["device"] = str(device)
    return info


def write_json(path: str | Path, payload, device=None) -> Path:
    """Write payload as JSON (parents created). A dict gets a "run" record unless it has one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(payload, dict) and "run" not in payload:
        payload = {"run": run_info(device), **payload}
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return path


def _sync(device) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn, device=None, iters: int = 10, warmup: int = 3) -> float:
    """Median host-clock milliseconds of fn(), the device synchronised around each call (host
    work included: for eager loops with host syncs)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def event_ms(fn, device=None, iters: int = 200, warmup: int = 20) -> float:
    """Median milliseconds of one fn() call: on a CUDA device `triton.testing.do_bench` (CUDA
    events, the L2 cache flushed between calls, as many calls as fit its 100 ms after a 25 ms
    warm-up; `iters` / `warmup` apply to the host clock only); the host clock elsewhere."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return wall_ms(fn, None, iters, warmup)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def graph_ms(fn, dev, iters: int):
    """fn() captured as one CUDA graph after two warm-up calls: (ms per replay over `iters`
    replays, the outputs of the captured call); (None, None) off CUDA."""
    import torch

    if dev.type != "cuda":
        return None, None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up: Triton compiles, cuBLAS handles, allocator
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / iters, 4), out


def attempt(results: dict, name: str, fn):
    """Run one part of a benchmark; on error record it in results["errors"], print it and go
    on. Writes results["partial_path"] (when set) after every part, so a run cut short by a
    time limit keeps what it finished."""
    t0 = time.perf_counter()
    try:
        out = fn()
        print(f"[ok] {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
        return out
    except Exception as err:  # noqa: BLE001 - a benchmark row must not stop the others
        print(f"[error] {name}: {err!r}", flush=True)
        traceback.print_exc()
        results["errors"][name] = repr(err)
        return None
    finally:
        if results.get("partial_path"):
            write_json(results["partial_path"], results)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Token identity of two runs over the same prompts: identical requests (of how many) and
    the mean share of each request's tokens before the first difference."""
    same = sum(x == y for x, y in zip(a, b))
    pref = []
    for x, y in zip(a, b):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        pref.append(k / max(len(x), 1))
    return {"identical": same, "of": len(a), "prefix_share": round(sum(pref) / len(pref), 4)}
