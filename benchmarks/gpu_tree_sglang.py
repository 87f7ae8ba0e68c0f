"""GPU bring-up of DFLASH_TREE in SGLang (issue 19): plain vs DFLASH vs DFLASH_TREE at node
budgets 16/32/64 (top-4), on the bundled pair, 1 and 8 concurrent requests, greedy.

Reports per (mode, concurrency), after an untimed pass at every concurrency (32 tokens of as many
prompts, so the first use of each batch shape stays out of the rows; the first H200 run warmed
1 request only, and its 8-request rows of DFLASH and DFLASH_TREE, about 1,000 tok/s, below
their 1-request rows, are likely cold: `gpu_engines.py`'s warmed DFLASH row had 9,508):
tokens/s (output tokens / wall time of the row), tau (sum completion_tokens / sum
spec_verify_ct, SGLang's own counters) and greedy token identity against the plain run
(requests identical / total, first differing position). One engine per
process (`run --mode M`, one JSON each); `all` runs every mode in turn as subprocesses (an engine
that fails to start is recorded as an error and the next mode still runs); `report` prints the
table. First bring-up: add `--eager` (no CUDA graphs) to separate the worker from the graph hook.

    O=benchmarks/results/gpu-tree-sglang
    SGLANG_PLUGINS=dflash_plugin python benchmarks/gpu_tree_sglang.py all --out $O --eager
    SGLANG_PLUGINS=dflash_plugin python benchmarks/gpu_tree_sglang.py all --out $O
    python benchmarks/gpu_tree_sglang.py report --out $O
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import checkout_first

checkout_first()  # this checkout's dflash_plugin (bench.engine_rows imports it)

from bench.engine_rows import EngineSpec, sglang_kwargs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "examples" / "fixtures"
MODES = ["plain", "dflash", "tree16", "tree32", "tree64"]  # `all`'s default; any treeN runs


def mode(text: str) -> str:
    """plain, dflash or treeN (a node budget N >= 1, top-K from --topk)."""
    if text in ("plain", "dflash") or (text.startswith("tree") and text[4:].isdigit()
                                       and int(text[4:]) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"mode: plain, dflash or treeN (N >= 1), got {text!r}")


def engine_kwargs(args, mode: str) -> dict:
    """`sgl.Engine` keywords of `mode` (`bench.engine_rows.sglang_kwargs`, as gpu_engines.py
    builds them): 16 running requests, decode graphs up to 16 and no prefill graphs unless
    --eager; DFLASH drafts 15, treeN verifies N nodes of top-K. --attention-backend, when given,
    applies to every mode (target and drafter); without it plain and DFLASH take SGLang's default
    and treeN flashinfer, except in fp32, where every mode takes triton (flashinfer and fa3 have
    no fp32 kernels)."""
    tree = mode.startswith("tree")
    backend = args.attention_backend or ("triton" if args.dtype in ("float32", "float") else None)
    spec = EngineSpec(engine="sglang", target=str(args.target),
                      draft=None if mode == "plain" else str(args.draft),
                      num_spec_tokens=int(mode[4:]) if tree else 15, dtype=args.dtype,
                      enforce_eager=args.eager, max_seqs=16, prefill_graphs=False,
                      graph_max_bs=16, log_level="info", tree_topk=args.topk if tree else None,
                      attention_backend=backend, deterministic=args.deterministic)
    return sglang_kwargs(spec)


def prompts(args) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    rows = [json.loads(line) for line in (FIX / "dev-prompts.jsonl").read_text().splitlines()]
    texts = [r.get("prompt") or r.get("text") for r in rows][: args.prompts]
    return [tok(t).input_ids for t in texts]


def run_row(engine, ids: list[list[int]], conc: int, max_new: int) -> dict:
    todo, out = iter(range(len(ids))), [None] * len(ids)
    sp = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}

    async def worker():
        for i in todo:
            r = await engine.async_generate(input_ids=ids[i], sampling_params=sp)
            out[i] = (list(r["output_ids"]), r["meta_info"].get("spec_verify_ct"))

    async def main():
        await asyncio.gather(*(worker() for _ in range(conc)))

    t0 = time.perf_counter()
    engine.loop.run_until_complete(main())
    wall = time.perf_counter() - t0
    toks = sum(len(o[0]) for o in out)
    rounds = [o[1] for o in out]
    return {"concurrency": conc, "tokens_per_s": toks / wall, "wall_s": wall,
            "tau": toks / sum(rounds) if all(rounds) else None,
            "tokens": [o[0] for o in out]}


def cmd_run(args) -> None:
    import sglang

    ids = prompts(args)
    doc = {"mode": args.mode, "sglang": sglang.__version__, "kwargs": engine_kwargs(args,
           args.mode), "rows": []}
    path = Path(args.out) / f"{args.mode}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        engine = sglang.Engine(**doc["kwargs"])
    except Exception as e:  # recorded: the bring-up wants the reason, not a crash
        doc["error"] = f"{type(e).__name__}: {e}"
        path.write_text(json.dumps(doc, indent=1))
        raise
    try:
        for conc in args.concurrency:  # untimed: every batch shape's first use (lazy plans,
            run_row(engine, ids[:conc], conc, 32)  # JIT kernels) stays out of the timed rows
        for conc in args.concurrency:
            doc["rows"].append(run_row(engine, ids, conc, args.max_new_tokens))
            path.write_text(json.dumps(doc, indent=1))
    finally:
        engine.shutdown()


def cmd_all(args) -> None:
    base = [sys.executable, __file__, "run", "--out", args.out, "--topk", str(args.topk),
            "--dtype", args.dtype,
            "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
            "--concurrency", *map(str, args.concurrency)] + (["--eager"] if args.eager else [])
    base += ["--deterministic"] if args.deterministic else []
    if args.attention_backend:
        base += ["--attention-backend", args.attention_backend]
    env = dict(os.environ, SGLANG_PLUGINS=os.environ.get("SGLANG_PLUGINS", "dflash_plugin"))
    for mode in args.modes:
        print(f"== {mode}", flush=True)
        rc = subprocess.run(base + ["--mode", mode], env=env).returncode
        print(f"== {mode}: exit {rc}", flush=True)
    cmd_report(args)


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two greedy outputs differ, over the shorter one (a run of fewer
    new tokens compares its prefix; every row ignores EOS, so lengths differ only by settings)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def cmd_report(args) -> None:
    docs = {}
    for p in sorted(Path(args.out).glob("*.json")):
        doc = json.loads(p.read_text())
        if isinstance(doc, dict) and "mode" in doc:
            docs[p.stem] = doc
    docs = dict(sorted(docs.items(), key=lambda kv: kv[0] != "plain"))  # plain first
    plain = {r["concurrency"]: r for r in docs.get("plain", {}).get("rows", [])}
    print("| mode | conc | tok/s | x plain | tau | identical vs plain | first diff |")
    print("|---|---|---|---|---|---|---|")
    for m, d in docs.items():
        if d.get("error"):
            print(f"| {m} | - | error: {d['error'][:80]} | | | | |")
        for r in d.get("rows", []):
            ref = plain.get(r["concurrency"])
            same = diffs = "-"
            speed = "-"
            if ref:
                pairs = list(zip(r["tokens"], ref["tokens"]))
                same = f"{sum(first_diff(a, b) is None for a, b in pairs)}/{len(pairs)}"
                diffs = str(min((d for d in (first_diff(a, b) for a, b in pairs)
                                 if d is not None), default="-"))
                speed = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}"
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            print(f"| {m} | {r['concurrency']} | {r['tokens_per_s']:.0f} | {speed} | {tau} | "
                  f"{same} | {diffs} |")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "all", "report"):
        s = sub.add_parser(name)
        s.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu-tree-sglang"))
        if name == "report":
            continue
        s.add_argument("--target", type=Path, default=FIX / "code-target")
        s.add_argument("--draft", type=Path, default=FIX / "code-target-dflash-b16")
        s.add_argument("--topk", type=int, default=4)
        s.add_argument("--prompts", type=int, default=16)
        s.add_argument("--max-new-tokens", type=int, default=256)
        s.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
        s.add_argument("--attention-backend", default=None,
                       help="every mode's (default: SGLang's; treeN flashinfer; fp32 triton)")
        s.add_argument("--eager", action="store_true", help="disable CUDA graphs")
        s.add_argument("--deterministic", action="store_true",
                       help="SGLang's batch-invariant kernels (2026-12-02: DFLASH 8 / 8 equal "
                            "to plain; trees, verified through another backend, 4 / 8)")
        s.add_argument("--dtype", default="bfloat16",
                       help="float32 fails in SGLang 0.5.16 on CUDA (sgl-kernel's rmsnorm); "
                            "benchmarks/greedy_margins.py checks bf16 outputs instead")
        if name == "run":
            s.add_argument("--mode", type=mode, required=True)
        else:
            s.add_argument("--modes", nargs="+", type=mode, default=MODES)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    {"run": cmd_run, "all": cmd_all, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
