"""Issue 20 in SGLang: one DFLASH_ADAPTIVE server (block length chosen per step) beside plain
serving and fixed DFLASH (k = 15), at 1, 4, 8, 16, 32, 64 concurrent requests (greedy; with
`--temperature T` the timed rows sample at T, the identity check of the outputs stays greedy),
on the bundled pair (GPU only: SGLang runs DFLASH on CUDA only).

Per mode one `sglang.Engine` in its own process (`run --mode M` writes `M.json`; `all` runs the
modes in turn, an engine that fails is recorded and the next still runs): the cells of
`dflash tune` (`sglang_tune.measure_engine`: an untimed pass at every concurrency, then per
concurrency max(--waves x c, --min-requests) requests of 128 tokens, timed (default max(16c,
64), served again until the row has run --min-seconds, default 3: a 3 % goal needs windows of
seconds; until 2026-12-03 max(2c, 16), windows of 0.3-3.5 s, then 0.4-2 s from 8 requests on;
until 2026-12-06 max(2c, 64): each serving of the requests is a closed loop that ends in a
drain, and a DFLASH-family server's requests finish at different steps, so at 2 waves its
batches ran part-empty: 23,703 against 31,210 tok/s at 16 waves for one adaptive server at 32
requests, BENCHMARKS.md "Steady load");
tau = tokens / SGLang's `spec_verify_ct`; `--repeats R`: all rows R times in turn on the same
server, the median row reported with the range: one 4-second window per row moved a ratio by 3-4
points between two runs in 2026-12-06's 8B rows; `--starts S` (with `all`): each mode's server
started S times, the modes in turn (plain, dflash, adaptive, plain, ...), each start's rows in
`start-N/M.json` and the median start per concurrency in `M.json`, the range over every run: the
fixture's rows moved by up to 40 % from one server start to the next on an H100, DFLASH's own
included, 2026-12-06), and the greedy outputs of the first 16 prompts
(4 at a time) for token identity between modes; `--length-spread S`: the rows' output
lengths from 128 (1 - S) to 128 (1 + S), interleaved, so requests finish and new ones are
prefilled at any step, as in serving (default 0: every request 128 tokens, arriving in
waves). Each `M.json` holds `host`: the cores, the load, the GPU's clocks and the CPU use over
the rows of the server's processes, and per row the host's busy and stolen CPU share and the
busiest process's cores (`bench.host_snapshot`; a line per server start in the report), to tell
what differs between starts and between rows. DFLASH_ADAPTIVE reads the step times of a
`dflash tune --engine sglang` report (`--config`) and logs its steps per block length every 200
steps (DFLASH_ADAPTIVE_LOG_EVERY).

    O=benchmarks/results/gpu-adaptive-sglang
    python benchmarks/gpu_adaptive_sglang.py all --out $O \
        --config benchmarks/results/gpu-engines/tune-sglang.json
    python benchmarks/gpu_adaptive_sglang.py report --out $O

`profile` runs each mode's engine with the stack sampler (`benchmarks/stack_sampler`) on its
processes: per concurrency an untimed pass, then 16 x c requests of 128 tokens sampled and
timed (`M-profile.json`), and `stack_report.py`'s call tree of SGLang's scheduler loop per
mode (`stacks-M.json`): where a decode step's host time goes.

    python benchmarks/gpu_adaptive_sglang.py profile --modes plain,adaptive-q1 \
        --concurrency 16,64 --out $O-profile

`--trace 1x16,64x512,...` adds a moving load to `run` / `all`: after the rows, on the same
warm server, phases of N requests C at a time back to back (`trace` in `M.json`); `report`
sets each mode's whole-trace tokens/s beside the best single server (plain or DFLASH for the
whole trace: what a static per-deployment choice can reach) and the per-phase best.

`breakdown --out $O-profile` turns the samples (stacks/ or stacks.tgz) into milliseconds per
decode step of the main parts of the loop (`PARTS`; steps = tokens / c, or SGLang's verify
rounds / c).

`--shape qwen3-8b`: the target at Qwen3-8B's shape with random weights (load_format "dummy")
and a random 5-layer drafter for it (`bench.engine_rows.shaped_model_dirs`, the fixture's
tokenizer): what the steps cost where the GPU, not the host, sets the pace (acceptance
there is meaningless; the fixture's gives the gain).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import checkout_first
from bench.host_snapshot import counters, cpu_use, host_line, interval, snapshot
from bench.sglang_steps import breakdown, print_breakdown, profile_mode, trace_phase, trace_report

checkout_first()

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "examples" / "fixtures"
MODES = ["plain", "dflash", "adaptive"]
# adaptive-q1: DFLASH_ADAPTIVE given only plain step times, so every decode step is q = 1 (its
# plain step, drafter KV still written): what a plain step costs inside the DFLASH worker
ALL_MODES = MODES + ["adaptive-q1"]
LABEL_K = {"plain": 0, "dflash": 15, "adaptive": 15, "adaptive-q1": 15}  # tau for k > 0


def start(args, mode: str):
    from bench.engine_cli import q1_config  # imports dflash_plugin: after checkout_first

    from dflash_plugin.engines.sglang_tune import start as start_engine

    extra = {}
    if args.load_format:  # the target's; the drafter's random weights are files
        extra.update(load_format=args.load_format)
        if mode != "plain":
            extra.update(speculative_draft_load_format="auto")
    if mode.startswith("adaptive"):
        config = args.config
        if mode == "adaptive-q1":
            config = q1_config(args.config, args.out)
        # log_level warning: the worker's step counts and times reach the log
        extra.update(speculative_algorithm="DFLASH_ADAPTIVE",
                     speculative_draft_model_path=str(args.draft),
                     speculative_adaptive_config=str(config), log_level="warning")
    if args.log_level:  # info: SGLang's "Decode batch" lines (cuda graph used, gen throughput)
        extra.update(log_level=args.log_level)
    return start_engine(str(args.target), str(args.draft), 15 if mode == "dflash" else 0,
                        max_running_requests=max(args.concurrency), dtype=args.dtype,
                        max_model_len=args.context_length, extra=extra)


def run_mode(args, mode: str) -> dict:
    from dflash_plugin.engines.sglang_tune import closed_loop, measure_engine
    from dflash_plugin.engines.vllm_tune import prompt_ids
    from dflash_plugin.training.data import load_prompts_jsonl

    # (until 2026-12-03 this passed the file's path, so each prompt was one of its characters)
    keep = 2048 - args.max_new_tokens - 24
    ids = prompt_ids(str(args.target), load_prompts_jsonl(args.prompts),
                     min(keep, args.prompt_tokens or keep))
    t0 = time.perf_counter()
    engine = start(args, mode)
    started = time.perf_counter() - t0
    host = {"before_rows": snapshot()}  # cores and CPU time of the server's processes
    marks = [("start", counters())]  # then one after each timed row (its log line)

    def log(line: str) -> None:
        print(line, flush=True)
        marks.append((line, counters()))
    try:
        if "STACK_SAMPLE_DIR" in os.environ:  # `profile`: sampled rows only
            rows = profile_mode(engine, ids, args.concurrency, args.requests_per_slot,
                                args.max_new_tokens)
            return {"mode": mode, "start_s": started, "rows": rows, "config": str(args.config)}
        runs = [measure_engine(engine, LABEL_K[mode], ids, args.concurrency,
                               temperature=args.temperature, spread=args.length_spread,
                               max_new_tokens=args.max_new_tokens, waves=args.waves,
                               min_requests=args.min_requests, min_seconds=args.min_seconds,
                               warmup_tokens=8, log=log)
                for _ in range(args.repeats)]
        host.update(after_rows=snapshot(), rows_s=marks[-1][1]["t"] - marks[0][1]["t"])
        # per row (a repeat's first also holds its untimed pass): steal, busy, top process
        host["rows"] = [dict(row=line, **interval(a, b))
                        for (_, a), (line, b) in zip(marks, marks[1:])]
        host["cpu_use"] = cpu_use(host["before_rows"], host["after_rows"], host["rows_s"])
        outs = closed_loop(engine, ids[:16], args.max_new_tokens, 4)  # greedy: identity
        trace = [trace_phase(engine, ids, c, n, args.max_new_tokens)
                 for c, n in args.trace or []]
    finally:
        engine.shutdown()
    return {"mode": mode, "start_s": started, "temperature": args.temperature,
            "length_spread": args.length_spread,
            "cells": [asdict(c) for c in median_cells(runs)],
            "repeats": [[c.tokens_per_s for c in r] for r in runs],  # [repeat][concurrency]
            "outputs": [o.token_ids for o in outs], "config": str(args.config),
            "trace": trace, "host": host}


def median_cells(runs: list[list], tps=lambda c: c.tokens_per_s) -> list:
    """Per concurrency the run's cell with the median tokens/s (the lower of two middles):
    runs[r][i] is run r's cell of the i-th concurrency, every run in the same order; `tps`
    reads a cell's tokens/s (a `Cell`, or its dict from a results file)."""
    return [sorted(cells, key=tps)[(len(cells) - 1) // 2] for cells in zip(*runs)]


def merge_starts(out: Path, modes: list[str], n: int) -> None:
    """Each mode's `M.json` from its servers' `start-1..n/M.json`: per concurrency the median
    start's row, every start's runs as `repeats` (the report's range spans them all), per start
    its start-up time and rows (`starts`), whether their greedy outputs agree, and how many
    starts failed (their `M.error` beside)."""
    for m in modes:
        docs = [json.loads(p.read_text()) for s in range(1, n + 1)
                if (p := out / f"start-{s}" / f"{m}.json").is_file()]
        if not docs:
            continue
        merged = dict(docs[0], cells=median_cells([d["cells"] for d in docs],
                                                  lambda c: c["tokens_per_s"]))
        merged.update(repeats=[r for d in docs for r in d["repeats"]],
                      starts=[{"start_s": d["start_s"], "host": d.get("host"),
                               "tokens_per_s": [c["tokens_per_s"] for c in d["cells"]]}
                              for d in docs],
                      outputs_agree=all(d["outputs"] == docs[0]["outputs"] for d in docs),
                      starts_failed=n - len(docs))
        (out / f"{m}.json").write_text(json.dumps(merged))


def spread(doc: dict, i: int) -> str:
    """' (min-max)' of the i-th concurrency's tokens/s over a mode's repeats; '' for one run."""
    got = [r[i] for r in doc.get("repeats", [])]
    return f" ({min(got):.0f}-{max(got):.0f})" if len(got) > 1 else ""


def identity(a: list[list[int]], b: list[list[int]]) -> dict:
    """Requests with identical outputs, and the first differing position of each other one."""
    firsts = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
              for p, q in zip(a, b) if p != q]
    return {"identical": len(a) - len(firsts), "total": len(a), "first_diff": firsts}


def report(out: Path) -> None:
    docs = {m: json.loads((out / f"{m}.json").read_text()) for m in ALL_MODES
            if (out / f"{m}.json").is_file()}
    rows = {}
    for m, d in docs.items():
        for i, c in enumerate(d.get("cells", [])):
            rows.setdefault(c["concurrency"], {})[m] = dict(c, spread=spread(d, i))
    print("| requests | " + " | ".join(f"{m} tok/s" for m in docs) + " | adaptive / max |")
    print("|---" * (len(docs) + 2) + "|")
    for c, r in sorted(rows.items()):
        best = max((r[m]["tokens_per_s"] for m in ("plain", "dflash") if m in r), default=0)
        ad = r.get("adaptive", {}).get("tokens_per_s")
        cols = " | ".join(f"{r[m]['tokens_per_s']:.0f}{r[m]['spread']}" if m in r else "-"
                          for m in docs)
        print(f"| {c} | {cols} | {ad / best:.3f} |" if ad and best else f"| {c} | {cols} | - |")
    for m, d in docs.items():
        if "starts" in d:
            print(f"{m}: {len(d['starts'])} server starts ({d['starts_failed']} failed), "
                  f"greedy outputs alike in all: {d['outputs_agree']}")
        for i, st in enumerate(d.get("starts") or [d]):  # where its processes ran
            if st.get("host"):
                print(f"  {m} start {i + 1}: {host_line(st['host'])}")
    for m in ("dflash", "adaptive", "adaptive-q1"):
        if "plain" in docs and m in docs:
            print(m, "vs plain:", identity(docs["plain"]["outputs"], docs[m]["outputs"]))
    if "dflash" in docs and "adaptive" in docs:
        print("adaptive vs dflash:", identity(docs["dflash"]["outputs"],
                                              docs["adaptive"]["outputs"]))
    trace_report(docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["run", "all", "report", "profile", "breakdown"])
    ap.add_argument("--mode", choices=ALL_MODES)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target", type=Path, default=FIX / "code-target")
    ap.add_argument("--draft", type=Path, default=FIX / "code-target-dflash-b16")
    ap.add_argument("--prompts", type=Path, default=FIX / "dev-prompts.jsonl")
    ap.add_argument("--config", type=Path,
                    default=ROOT / "benchmarks/results/gpu-engines/tune-sglang.json")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--length-spread", type=float, default=0.0,
                    help="rows: output lengths from N (1 - S) to N (1 + S) for --max-new-tokens "
                         "N, interleaved, so requests finish and arrive at any step (as in "
                         "serving), not in waves; S in [0, 1), default 0 (every request N)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the timed rows' (top-p 1); the identity check stays greedy")
    ap.add_argument("--prompt-tokens", type=int,
                    help="keep the last N tokens of each prompt (default: all, 362 on average "
                         "for the dev prompts): short prompts leave the rows to decode steps")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context-length", type=int, default=2048,
                    help="every server's --context-length (default 2048; SGLang also caps its "
                         "prefill CUDA graphs there, so a prefill pass of more tokens runs "
                         "eagerly); prompts keep their last 2048 - N - 24 tokens either way")
    ap.add_argument("--shape", choices=["qwen3-8b"], help="random weights at this shape")
    ap.add_argument("--load-format", help=argparse.SUPPRESS)  # set for the children by --shape
    ap.add_argument("--requests-per-slot", type=int, default=16, help="profile: requests / c")
    ap.add_argument("--waves", type=int, default=16,
                    help="rows: at least waves x c requests, one closed loop (default 16: the "
                         "loop's drain is a sixteenth of it; 2 until 2026-12-06)")
    ap.add_argument("--min-seconds", type=float, default=3.0,
                    help="rows: those requests again until the row has run this long")
    ap.add_argument("--min-requests", type=int, default=64, help="rows: at least this many")
    ap.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                    help="every engine's SGLang log level (default: warning for DFLASH_ADAPTIVE, "
                         "SGLang's own otherwise); info adds SGLang's decode-batch lines every "
                         "40 steps, alike in every mode")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rows: every concurrency's row this many times on the same server, "
                         "all rows in turn; the median row is reported, with the range")
    ap.add_argument("--starts", type=int, default=1,
                    help="all: each mode's server started this many times, the modes in turn; "
                         "the median start's row is reported, with the range of every run")
    ap.add_argument("--trace", type=lambda s: [tuple(int(v) for v in p.split("x"))
                                               for p in s.split(",")],
                    help="a moving load after the rows, on the same server: CxN phases "
                         "(N requests, C at a time), e.g. 1x16,64x512,4x64,32x256,1x16")
    args = ap.parse_args()
    if not args.temperature >= 0:
        ap.error(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 <= args.length_spread < 1:
        ap.error(f"--length-spread must be in [0, 1), got {args.length_spread}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.context_length < 2048:
        ap.error(f"--context-length must be >= 2048 (the prompts' room), got "
                 f"{args.context_length}")
    if args.starts < 1:
        ap.error(f"--starts must be >= 1, got {args.starts}")
    if args.starts > 1 and (args.cmd != "all" or args.trace):
        ap.error("--starts > 1 needs `all` and no --trace (one moving load per mode)")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        ap.error(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cmd == "report":
        return report(args.out)
    if args.cmd == "breakdown":
        return print_breakdown(breakdown(args.out))
    if args.cmd == "run":
        if args.mode is None:
            ap.error("run needs --mode")
        doc = run_mode(args, args.mode)
        name = f"{args.mode}-profile" if "rows" in doc else args.mode
        (args.out / f"{name}.json").write_text(json.dumps(doc))
        return
    rest = sys.argv[2:]
    keep = [a for i, a in enumerate(rest) if not a.startswith("--modes")
            and not (i and rest[i - 1] == "--modes")]
    if args.shape:
        from bench.engine_rows import shaped_model_dirs

        work = Path(tempfile.mkdtemp(prefix="adaptive-shape-"))  # ~2 GB of drafter
        target, draft = shaped_model_dirs(args.shape, args.target, work, draft_weights=True)
        keep += ["--target", str(target), "--draft", str(draft), "--load-format", "dummy"]
    modes = args.modes.split(",")
    for s, m in ((s, m) for s in range(1, args.starts + 1) for m in modes):
        out = args.out / f"start-{s}" if args.starts > 1 else args.out
        out.mkdir(exist_ok=True)
        cmd = [sys.executable, __file__, "run", "--mode", m, *keep, "--out", str(out),
               "--starts", "1"]  # the last of a repeated flag counts
        env = dict(os.environ, DFLASH_ADAPTIVE_LOG_EVERY=os.environ.get(
            "DFLASH_ADAPTIVE_LOG_EVERY", "200"))
        stacks = args.out / "stacks" / m
        if args.cmd == "profile":
            env.update(STACK_SAMPLE_DIR=str(stacks), PYTHONPATH=os.pathsep.join(
                [str(ROOT / "benchmarks" / "stack_sampler"), env.get("PYTHONPATH", "")]))
        rc = subprocess.run(cmd, env=env).returncode
        if rc:
            (out / f"{m}.error").write_text(f"exit {rc}\n")
        if args.cmd == "profile" and stacks.is_dir():
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stack_report.py"),
                            str(stacks), "--json", str(args.out / f"stacks-{m}.json")])
    if args.starts > 1:
        merge_starts(args.out, modes, args.starts)
    if args.cmd == "all":
        report(args.out)
    if args.cmd == "profile":
        print_breakdown(breakdown(args.out))


if __name__ == "__main__":
    main()
