r"""Spiffy and SpecFold inside SGLang's GPU engine, side by side with SGLang's own one-step
decoding of the same diffusion LM: tokens/s, forwards, greedy token identity, CUDA graphs on/off.

On the GPU machine (SGLang importable, repo root as working directory):

    W=out/gpu-dllm O=benchmarks/results/gpu-dllm  # each run: one engine start, 1-2 min
    python benchmarks/gpu_dllm.py prepare --work $W          # SDAR conversion + YAMLs, seconds
    python benchmarks/gpu_dllm.py run --work $W --algorithm LowConfidence --out $O/lowconf.json
    python benchmarks/gpu_dllm.py run --work $W --algorithm Spiffy --out $O/spiffy.json
    python benchmarks/gpu_dllm.py run --work $W --algorithm Spiffy --eager --out $O/spiffy-e.json
    python benchmarks/gpu_dllm.py run --work $W --algorithm SpecFold --eager --out $O/specfold.json
    python benchmarks/gpu_dllm.py report --inputs $O/*.json --out-md $O/report.md

Method: `prepare` converts the bundled code-dllm to SDAR (`spiffy convert-sdar`) and writes
three algorithm configs: SGLang's builtin `LowConfidence` at threshold 1.0 (no confidence
exceeds 1, so it unmasks the single most confident position per forward: one-step vanilla-1
decoding), and Spiffy / SpecFold (delta --delta) with the committed draft graph
(`graph-vanilla1-d8.json`: calibrated on CPU in fp32 under the vanilla-1 rule, D = D* = 8, on dev
prompts 32-39, as `benchmarks/sglang_spiffy_nfe.py` does). Greedy Spiffy decodes the same
trajectory as one-step decoding in fewer forwards, so outputs must equal LowConfidence's.
`run` starts one `sgl.Engine` (bf16, SGLang's GPU attention backend; CUDA graphs for every
batch up to --graph-max-bs sequences unless --eager; a Spiffy forward holds 1 + D* sequences per
request), times the first request alone (cold), then an untimed pass over all prompts at every
concurrency (--warmup-tokens new tokens), then per concurrency one timed closed-loop pass (see
bench/engine_rows.py): wall time, output tokens/s, every prompt's output ids. Forwards: the sum of
the algorithm's own per-block log lines ("Spiffy block: ... forwards=F steps=S"); one-step
decoding of the same blocks takes S + 1 forwards per block. The engine runs at log level "info"
(sgl.Engine's default, "error", drops those lines); its log goes to --log.

Tensor parallelism (issue 22, an `nvidia-h200-x2` machine): `run --tp 2` starts the engine with
SGLang's tp_size = 2 (and NVLink multicast off, bench/engine_rows.py MULTICAST_OFF, unless the
environment sets it; the doc's "env" records it). Every rank's scheduler runs the algorithm and
logs its blocks (lines tagged "TP0", "TP1"): forwards count the lowest rank's lines,
"block_lines_per_rank" the lines of each. `report` keeps TP 1 and TP 2 apart (LowConfidence of
the same TP is the reference) and adds each TP 2 run's identity against the TP 1 run of the
same algorithm and graphs; `compare A.json B.json` prints one such pair. Spiffy and SpecFold
(and LowConfidence, the reference) at TP 2 and TP 1 on the same machine (each run 1-2 min;
SGLang 0.5.16 runs SpecFold unfolded, folding needs >= 0.5.21):

    W=out/gpu-dllm O=benchmarks/results/gpu-dllm-tp2
    python benchmarks/gpu_dllm.py prepare --work $W
    for tp in 2 1; do
      python benchmarks/gpu_dllm.py run --work $W --tp $tp --algorithm LowConfidence \
          --out $O/lowconf-tp$tp.json
      python benchmarks/gpu_dllm.py run --work $W --tp $tp --algorithm Spiffy \
          --out $O/spiffy-tp$tp.json
      python benchmarks/gpu_dllm.py run --work $W --tp $tp --algorithm SpecFold --eager \
          --out $O/specfold-e-tp$tp.json
    done
    for r in lowconf spiffy specfold-e; do
      python benchmarks/gpu_dllm.py compare $O/$r-tp2.json $O/$r-tp1.json \
          --out-json $O/identity-$r.json
    done
    python benchmarks/gpu_dllm.py report --inputs $O/*-tp?.json --out-md $O/report.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.common import agreement
from bench.engine_report import add_report_commands, parse_tp_args, render_tp_identity, tp_of
from bench.engine_rows import EngineSpec, Sampling, engine_env, gpu_name, start_engine

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "examples" / "fixtures"
GRAPH = ROOT / "benchmarks" / "results" / "gpu-dllm" / "graph-vanilla1-d8.json"
BLOCK = re.compile(r"(Spiffy) block: rid=(\S+) forwards=(\d+) steps=(\d+) accepted=(\d+)")
RANK = re.compile(r"\bTP(\d+)\b")  # SGLang's scheduler log prefix under TP: "[date TP1] ..."
CONFIGS = {"LowConfidence": "lowconf.yaml", "Spiffy": "spiffy.yaml", "SpecFold": "specfold.yaml"}


def cmd_prepare(args) -> None:
    from spiffy_plugin.engines.sdar import convert_to_sdar

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    convert_to_sdar(args.model, work / "sdar")
    common = f"graph: {Path(args.graph).resolve()}\nmax_running_requests: {args.max_requests}\n"
    (work / "lowconf.yaml").write_text("threshold: 1.0\n")
    (work / "spiffy.yaml").write_text(common)
    (work / "specfold.yaml").write_text(common + f"delta: {args.delta}\n")
    print("prepared", work)


def prompt_ids(args) -> list[list[int]]:
    from transformers import AutoTokenizer

    from dflash_plugin.training.data import load_prompts_jsonl

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompts_jsonl(args.prompts)[: args.num_prompts]
    return [tok(p).input_ids[-args.max_prompt_tokens:] for p in prompts]


def block_counts(log: Path, start: int) -> dict:
    """Sums of the algorithm's per-block log lines written after byte `start` of the log; under
    TP every rank logs the same blocks: the lowest rank's lines count, and
    "block_lines_per_rank" gives every rank's line count (equal when the ranks kept step)."""
    text = log.read_bytes()[start:].decode(errors="replace") if log.exists() else ""
    ranks: dict[int, list[tuple]] = {}
    for line in text.splitlines():
        if m := BLOCK.search(line):
            r = RANK.search(line, 0, m.start())
            ranks.setdefault(int(r.group(1)) if r else 0, []).append(m.groups())
    if not ranks:  # no log lines (LowConfidence logs none)
        return {"blocks": None, "forwards": None, "steps": None, "one_step_forwards": None}
    blocks = ranks[min(ranks)]
    steps = sum(int(b[3]) for b in blocks)
    out = {"blocks": len(blocks), "forwards": sum(int(b[2]) for b in blocks), "steps": steps,
           "one_step_forwards": steps + len(blocks)}
    if len(ranks) > 1:
        out["block_lines_per_rank"] = {str(r): len(b) for r, b in sorted(ranks.items())}
    return out


def cmd_run(args) -> None:
    log = Path(args.log or Path(args.out).with_suffix(".log"))
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)  # the engine's processes inherit this stderr: their log lines land in `log`
    ids = prompt_ids(args)
    work = Path(args.work).resolve()  # the engine gets absolute model / config paths
    spec = EngineSpec(engine="sglang", target=str(work / "sdar"), draft=None, dtype=args.dtype,
                      max_model_len=args.max_model_len, seed=0, enforce_eager=args.eager,
                      max_seqs=args.max_running_requests, prefill_graphs=False,
                      dllm_algorithm=args.algorithm,
                      dllm_config=str(work / CONFIGS[args.algorithm]),
                      graph_max_bs=args.graph_max_bs, log_level="info", tp=args.tp,
                      attention_backend=args.attention_backend,
                      deterministic=args.deterministic)
    t0 = time.perf_counter()
    runner = start_engine(spec)
    doc = {"kind": "dllm-run", "engine": "sglang", "engine_version": runner.version,
           "algorithm": args.algorithm, "cuda_graphs": not args.eager, "tp": args.tp,
           "dtype": args.dtype, "device": gpu_name(), "env": engine_env(),
           "attention_backend": args.attention_backend, "deterministic": args.deterministic,
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "num_prompts": len(ids), "max_tokens": args.max_tokens,
           "prompt_tokens": [len(p) for p in ids], "startup_s": time.perf_counter() - t0,
           "rows": [], "complete": False}

    def greedy(n: int) -> list[Sampling]:
        return [Sampling(0.0, n, None) for _ in ids]

    try:
        t = time.perf_counter()
        runner.run(ids[:1], greedy(args.max_tokens)[:1], 1)
        doc["cold_first_request_s"] = time.perf_counter() - t
        for c in args.concurrency:  # untimed: every batch shape, graphs and kernels warm
            runner.run(ids, greedy(args.warmup_tokens), c)
        for c in args.concurrency:
            start = log.stat().st_size
            t = time.perf_counter()
            dones = runner.run(ids, greedy(args.max_tokens), c)
            wall = time.perf_counter() - t
            time.sleep(1.0)  # the scheduler logs a block just after streaming its output
            tokens = sum(len(d.token_ids) for d in dones)
            doc["rows"].append({"tp": args.tp, "concurrency": c, "wall_s": wall,
                                "output_tokens": tokens, "tokens_per_s": tokens / wall,
                                **block_counts(log, start),
                                "token_ids": [d.token_ids for d in dones]})
            print(f"{args.algorithm} graphs={not args.eager} TP={args.tp} c={c}: "
                  f"{tokens / wall:.1f} tok/s", flush=True)
            write(doc, args.out)
        doc["complete"] = True
    finally:
        write(doc, args.out)
        runner.close()


def write(doc: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))


def cmd_report(args) -> None:
    docs = [json.loads(Path(p).read_text()) for p in args.inputs]
    docs = [d for d in docs if d.get("kind") == "dllm-run"]
    base = {(tp_of(d), r["concurrency"]): r["token_ids"] for d in docs
            if d["algorithm"] == "LowConfidence" and d["cuda_graphs"] for r in d["rows"]}
    lines = ["| algorithm | CUDA graphs | TP | requests at once | tokens/s | vs LowConfidence | "
             "forwards (one-step: S + 1) | identical to LowConfidence, graphs, same TP |",
             "|---|---|---|---|---|---|---|---|"]
    speed = {(d["algorithm"], d["cuda_graphs"], tp_of(d), r["concurrency"]): r["tokens_per_s"]
             for d in docs for r in d["rows"]}
    for d in docs:
        tp = tp_of(d)
        for r in d["rows"]:
            c = r["concurrency"]
            ref = speed.get(("LowConfidence", True, tp, c))
            ids = base.get((tp, c))
            ag = agreement(ids, r["token_ids"]) if ids is not None else None
            same = f"{ag['identical']} / {ag['of']}" if ag else "n/a"
            fw = f"{r['forwards']} ({r['one_step_forwards']})" if r.get("forwards") else ""
            vs = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "n/a"
            lines.append(f"| {d['algorithm']} | {'on' if d['cuda_graphs'] else 'off'} | {tp} | "
                         f"{c} | {r['tokens_per_s']:.1f} | {vs} | {fw} | {same} |")
    cold = [f"- {d['algorithm']} (graphs {'on' if d['cuda_graphs'] else 'off'}, TP {tp_of(d)}): "
            f"engine start {d['startup_s']:.0f} s, first request "
            f"{d.get('cold_first_request_s', 0):.2f} s" for d in docs]
    head = docs[0] if docs else {}
    text = "\n".join([f"SGLang {head.get('engine_version')} on {head.get('device')}, "
                      f"{head.get('date')}, {head.get('dtype')}, {head.get('num_prompts')} "
                      f"prompts x {head.get('max_tokens')} tokens, greedy", "", *lines, "",
                      *cold, ""]) + render_tp_identity(docs)
    Path(args.out_md).write_text(text)
    print(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("prepare")
    q.set_defaults(func=cmd_prepare)
    q.add_argument("--work", required=True)
    q.add_argument("--model", default=str(FIX / "code-dllm"))
    q.add_argument("--graph", default=str(GRAPH))
    q.add_argument("--delta", type=float, default=0.1)
    q.add_argument("--max-requests", type=int, default=8,
                   help="the YAML's max_running_requests: requests denoised at once")
    r = sub.add_parser("run")
    r.set_defaults(func=cmd_run)
    r.add_argument("--work", required=True)
    r.add_argument("--algorithm", choices=sorted(CONFIGS), required=True)
    r.add_argument("--eager", action="store_true", help="no CUDA graphs (disable_cuda_graph)")
    r.add_argument("--model", default=str(FIX / "code-dllm"), help="tokenizer")
    r.add_argument("--prompts", default=str(FIX / "dev-prompts.jsonl"))
    r.add_argument("--num-prompts", type=int, default=16)
    r.add_argument("--max-prompt-tokens", type=int, default=1024)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--warmup-tokens", type=int, default=32)
    r.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    r.add_argument("--dtype", default="bfloat16",
                   help="float32 needs --eager --attention-backend triton: with CUDA graphs "
                        "SGLang forces flashinfer for dLLMs, which has no fp32 kernels")
    r.add_argument("--attention-backend", default=None,
                   help="SGLang's (default: its own with graphs, i.e. flashinfer for dLLMs; "
                        "flashinfer with --eager, where SGLang's Hopper default fa3 cannot run "
                        "dLLM forwards: H200, 2026-12-02)")
    r.add_argument("--deterministic", action="store_true",
                   help="SGLang's enable_deterministic_inference (batch-invariant kernels); "
                        "on the H200 (0.5.16, 2026-12-02) it crashed LowConfidence itself")
    r.add_argument("--max-model-len", type=int, default=2048)
    r.add_argument("--max-running-requests", type=int, default=80,
                   help="sequences per forward: requests x (1 + D*) for Spiffy")
    r.add_argument("--graph-max-bs", type=int, default=80)
    r.add_argument("--out", required=True)
    r.add_argument("--log", default=None, help="engine log (default: --out with .log)")
    r.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (SGLang tp_size)")
    add_report_commands(sub, cmd_report)
    args = parse_tp_args(p, argv)
    fp32 = getattr(args, "func", None) is cmd_run and args.dtype in ("float32", "float")
    if fp32 and (not args.eager or args.attention_backend != "triton"):
        p.error(f"--dtype {args.dtype}: needs --eager --attention-backend triton (with CUDA "
                "graphs SGLang forces flashinfer for dLLMs; flashinfer and fa3 have no fp32 "
                "kernels; SGLang 0.5.16's rmsnorm has none on CUDA either)")
    if getattr(args, "func", None) is cmd_run and args.eager and args.attention_backend is None:
        args.attention_backend = "flashinfer"  # what SGLang itself picks for dLLMs with graphs
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
