"""Reports of the engine benchmarks from their JSON files: `gpu_engines.py report` (plain vs
DFlash table per engine and TP, round-cost table, adaptive-k table, plot) and the T = 0 token
identity of two runs of one configuration at different tensor-parallel sizes (`tp_identity`:
`compare` of `gpu_engines.py` and `gpu_dllm.py`, and a section of both reports).

A run's TP is its doc's "tp" (runs from before the --tp flag have none: one GPU, TP 1). Token
identity is `bench.common.agreement` everywhere (identical prompts of how many, mean share of
each prompt's tokens before its first difference).
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import agreement

RUN_KINDS = ("engine-run", "dllm-run")  # docs with every prompt's output ids per row


def fmt(x, spec: str = ".1f", scale: float = 1.0) -> str:
    return "—" if x is None else format(x * scale, spec)


def tp_of(doc: dict) -> int:
    return doc.get("tp", 1)


def mode_label(doc: dict) -> str:
    """A run's speculative configuration: its mode, and for DFLASH_TREE (`--mode tree`) the
    node budget and top-K (`tree32-k4`), so several budgets sit side by side."""
    if doc.get("mode") == "tree":
        return f"tree{doc.get('num_spec_tokens')}-k{doc.get('tree_topk')}"
    return doc.get("mode")


def _pairs(docs: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    """(engine, TP) -> mode label -> the (last given) engine-run doc."""
    out: dict[tuple[str, int], dict[str, dict]] = {}
    for d in docs:
        if d.get("kind") == "engine-run":
            out.setdefault((d["engine"], tp_of(d)), {})[mode_label(d)] = d
    return out


def render_tables(docs: list[dict]) -> str:
    """Markdown: one row per (engine, TP, speculative mode, T, concurrency) pairing plain with
    that mode (DFlash, or a DFLASH_TREE budget), then the round-cost table. Identity = prompts
    whose token ids equal plain's (T=0 only)."""
    lines = ["| engine | TP | mode | T | concurrency | plain tok/s | spec tok/s | speedup | tau | "
             "TTFT plain / spec (ms) | identical at T=0 |", "|" + " --- |" * 11]
    for (engine, tp), modes in _pairs(docs).items():
        plain = modes.get("plain", {})
        prow = {(r["temperature"], r["concurrency"]): r for r in plain.get("rows", [])}
        for label in sorted(m for m in modes if m != "plain") or ["dflash"]:
            srow = {(r["temperature"], r["concurrency"]): r
                    for r in modes.get(label, {}).get("rows", [])}
            for key in sorted(set(prow) | set(srow)):
                a, b = prow.get(key, {}), srow.get(key, {})
                pt, st = a.get("tokens_per_s"), b.get("tokens_per_s")
                same = "—"
                if key[0] == 0 and a and b:
                    ag = agreement(b["output_token_ids"], a["output_token_ids"])
                    same = f"{ag['identical']} / {ag['of']}"
                ttft = (f"{fmt(a.get('ttft_s_median'), '.1f', 1e3)} / "
                        f"{fmt(b.get('ttft_s_median'), '.1f', 1e3)}")
                lines.append(f"| {engine} | {tp} | {label} | {key[0]:g} | {key[1]} | {fmt(pt)} | "
                             f"{fmt(st)} | {fmt(st / pt if pt and st else None, '.2f')} | "
                             f"{fmt(b.get('tau'), '.2f')} | {ttft} | {same} |")
    notes = [f"- {d['engine']} {d['engine_version']} {mode_label(d)} TP {tp_of(d)}: {d['device']}, "
             f"{d['dtype']}, {d['num_prompts']} prompts x {d['max_tokens']} new tokens, start-up "
             f"{d['startup_s']:.0f} s, cold first request {d['cold_first_request_s']:.2f} s, "
             f"{d['date'][:10]}{'' if d.get('complete') else ' (INCOMPLETE)'}"
             for d in docs if d.get("kind") == "engine-run"]
    out = "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
    cost: dict[tuple, dict[str, dict]] = {}
    for d in docs:
        if d.get("kind") == "round-cost":
            key = (d["engine"], tp_of(d), d["shape"], d["dtype"])
            cost.setdefault(key, {})[mode_label(d)] = d
    if cost:
        out += ("\n| engine | TP | shape | dtype | mode | plain ms / step | spec ms / round | "
                "round / step | spec tokens / round |\n" + "|" + " --- |" * 9 + "\n")
        for (engine, tp, shape, dtype), m in sorted(cost.items()):
            p = m.get("plain", {}).get("per_round_s")
            for label in sorted(x for x in m if x != "plain") or ["dflash"]:
                s = m.get(label, {}).get("per_round_s")
                out += (f"| {engine} | {tp} | {shape} | {dtype} | {label} | "
                        f"{fmt(p, '.2f', 1e3)} | {fmt(s, '.2f', 1e3)} | "
                        f"{fmt(s / p if p and s else None, '.2f')} | "
                        f"{fmt(m.get(label, {}).get('tokens_per_round'), '.2f')} |\n")
    return out


def render_adaptive(docs: list[dict]) -> str:
    """Markdown per `dflash tune` report (T = its temperature): tokens/s per concurrency of
    plain (k = 0), every fixed k it measured, the adaptive choice (its k per concurrency) and
    its per-batch-size table config (`--check-table`, or a `run --mode tuned` doc at the same
    TP), and the ratio of adaptive / table to the best of plain and the largest fixed k."""
    out = ""
    tuned_runs = {(tp_of(d), r["concurrency"]): r["tokens_per_s"] for d in docs
                  if d.get("kind") == "engine-run" and d.get("mode") == "tuned"
                  for r in d["rows"] if r["temperature"] == 0}
    for d in docs:
        if d.get("kind") != "dflash-tune":
            continue
        cells = {(c["concurrency"], c["k"]): c["tokens_per_s"] for c in d["cells"]}
        ks = sorted({k for _, k in cells})
        table = ({c["concurrency"]: c["tokens_per_s"]
                  for c in d.get("vllm", {}).get("table_check", [])}
                 or {c: v for (tp, c), v in tuned_runs.items() if tp == tp_of(d)})
        kmax = max(ks)
        head = (["concurrency"] + ["plain" if k == 0 else f"k={k}" for k in ks]
                + ["adaptive (k)", "table config", f"adaptive / max(plain, k={kmax})",
                   f"table / max(plain, k={kmax})"])
        lines = [f"{d['engine']} {d.get('engine_version', '')}: dflash tune, TP {tp_of(d)}, "
                 f"T={d.get('settings', {}).get('temperature', 0)}, min_gain {d['min_gain']}",
                 "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for c in sorted({c for c, _ in cells}):
            ch = d["choice"][str(c)]
            ref = max(cells.get((c, 0), 0), cells.get((c, kmax), 0))
            t = table.get(c)
            lines.append("| " + " | ".join(
                [str(c)] + [fmt(cells.get((c, k))) for k in ks]
                + [f"{fmt(ch['tokens_per_s'])} ({ch['k']})", fmt(t),
                   fmt(ch["tokens_per_s"] / ref if ref else None, ".3f"),
                   fmt(t / ref if ref and t else None, ".3f")]) + " |")
        cfg = d.get("vllm", {}).get("speculative_config_table")
        out += "\n".join(lines) + f"\n\ntuned --speculative-config: `{json.dumps(cfg)}`\n\n"
    return out


def render_plot(docs: list[dict], path: str) -> str:
    """tokens/s and speedup against concurrency, one line per (engine, TP, T); needs
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not importable: no plot written ({path})"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colours = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    ticks: set[int] = set()
    for (engine, tp), modes in _pairs(docs).items():
        name = engine if tp == 1 else f"{engine} TP{tp}"
        for temp in sorted({r["temperature"] for d in modes.values() for r in d["rows"]}):
            colour, series = next(colours), {}
            for mode, d in modes.items():
                rows = sorted((r for r in d["rows"] if r["temperature"] == temp),
                              key=lambda r: r["concurrency"])
                series[mode] = {r["concurrency"]: r["tokens_per_s"] for r in rows}
                ticks |= set(series[mode])
                ax1.plot(list(series[mode]), list(series[mode].values()), marker="o",
                         color=colour, linestyle="-" if mode == "dflash" else "--",
                         label=f"{name} {mode} T={temp:g}")
            if len(series) == 2:
                cs = sorted(set(series["plain"]) & set(series["dflash"]))
                ax2.plot(cs, [series["dflash"][c] / series["plain"][c] for c in cs],
                         marker="o", color=colour, label=f"{name} T={temp:g}")
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


# --- TP = N against TP = 1: T = 0 token identity of one configuration -----------------------

def run_name(doc: dict) -> str:
    """The configuration a run measured, TP aside: engine + mode (`gpu_engines.py run`), or
    engine + algorithm + CUDA graphs (`gpu_dllm.py run`)."""
    if doc.get("kind") == "dllm-run":
        return f"{doc['engine']} {doc['algorithm']} graphs {'on' if doc['cuda_graphs'] else 'off'}"
    return f"{doc.get('engine')} {doc.get('mode')}"


def greedy_outputs(doc: dict) -> dict[int, list[list[int]]]:
    """concurrency -> every prompt's output token ids in the run's T = 0 rows
    (`gpu_engines.py`: "output_token_ids" of the rows at temperature 0; `gpu_dllm.py`:
    "token_ids", every row greedy)."""
    return {r["concurrency"]: r["output_token_ids"] if "output_token_ids" in r
            else r["token_ids"] for r in doc.get("rows", []) if r.get("temperature", 0) == 0}


def tp_identity(a: dict, b: dict) -> dict:
    """T = 0 token identity of run `a` against run `b` of the same configuration (e.g. TP = 2
    against TP = 1) at every concurrency both ran: `agreement` and the indices of the prompts
    that differ; beside it each run's own identity between its lowest concurrency and this one
    (what batch shapes alone change at a fixed TP). ValueError when the runs do not match
    (configuration, prompts, new tokens, dtype, draft tokens)."""
    bad = [k for k in ("num_prompts", "prompt_tokens", "max_tokens", "dtype", "num_spec_tokens")
           if a.get(k) != b.get(k)]
    if a.get("kind") not in RUN_KINDS or run_name(a) != run_name(b):
        bad.insert(0, f"configuration ({run_name(a)} vs {run_name(b)})")
    if bad:
        raise ValueError(f"runs differ in {', '.join(bad)}")
    ga, gb = greedy_outputs(a), greedy_outputs(b)
    rows = [{"concurrency": c, **agreement(ga[c], gb[c]),
             "differ": [i for i, (x, y) in enumerate(zip(ga[c], gb[c])) if x != y],
             "a_lowest_vs_this": agreement(ga[min(ga)], ga[c]),
             "b_lowest_vs_this": agreement(gb[min(gb)], gb[c])}
            for c in sorted(set(ga) & set(gb))]
    return {"kind": "tp-identity", "run": run_name(a), "a_tp": tp_of(a), "b_tp": tp_of(b),
            "rows": rows}


def render_identity(res: dict) -> str:
    a, b = f"TP {res['a_tp']}", f"TP {res['b_tp']}"
    lines = [f"{res['run']}: T = 0 outputs, {a} vs {b}", "",
             f"| concurrency | identical, {a} vs {b} | mean prefix share | differing prompts | "
             f"{a}: lowest concurrency vs this | {b}: lowest concurrency vs this |",
             "|" + " --- |" * 6]
    for r in res["rows"]:
        own = [f"{x['identical']} / {x['of']}" for x in (r["a_lowest_vs_this"],
                                                         r["b_lowest_vs_this"])]
        lines.append(f"| {r['concurrency']} | {r['identical']} / {r['of']} | "
                     f"{r['prefix_share']:.4f} | {', '.join(map(str, r['differ'])) or '—'} | "
                     f"{own[0]} | {own[1]} |")
    return "\n".join(lines) + "\n"


def render_tp_identity(docs: list[dict]) -> str:
    """Markdown: each run at TP != 1 against the (last given) TP = 1 run of its configuration;
    "" when no such pair is among the docs."""
    ref = {run_name(d): d for d in docs if d.get("kind") in RUN_KINDS and tp_of(d) == 1}
    out = []
    for d in docs:
        if d.get("kind") in RUN_KINDS and tp_of(d) != 1 and run_name(d) in ref:
            try:
                out.append(render_identity(tp_identity(d, ref[run_name(d)])))
            except ValueError as err:
                out.append(f"{run_name(d)}: TP {tp_of(d)} vs TP 1 not compared: {err}\n")
    return "\n" + "\n".join(out) if out else ""


def add_report_commands(sub, cmd_report, plot: bool = False) -> None:
    """`report --inputs ... --out-md [--out-png]` (running `cmd_report`) and `compare` on an
    argparse subparsers object."""
    m = sub.add_parser("report", help="merge JSONs into a markdown table"
                       + (" and a PNG plot" if plot else ""))
    m.add_argument("--inputs", nargs="+", required=True)
    m.add_argument("--out-md", required=True)
    if plot:
        m.add_argument("--out-png", default=None)
    m.set_defaults(func=cmd_report)
    add_compare_command(sub)


def parse_tp_args(p, argv):
    """`p.parse_args(argv)`, refusing `--tp` below 1."""
    args = p.parse_args(argv)
    if getattr(args, "tp", 1) < 1:
        p.error("--tp needs at least 1 GPU")
    return args


def add_compare_command(sub) -> None:
    """The `compare A.json B.json` subcommand (on an argparse subparsers object)."""
    c = sub.add_parser("compare", help="T = 0 token identity of two runs of one configuration "
                       "(e.g. TP = 2 against TP = 1), per concurrency")
    c.add_argument("a", help="run JSON, e.g. the TP = 2 run")
    c.add_argument("b", help="run JSON of the same configuration, e.g. the TP = 1 run")
    c.add_argument("--out-md", default=None)
    c.add_argument("--out-json", default=None)
    c.set_defaults(func=cmd_compare)


def cmd_compare(args) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    try:
        res = tp_identity(a, b)
    except ValueError as err:
        raise SystemExit(f"{args.a} vs {args.b}: {err}") from None
    res.update(a_path=args.a, b_path=args.b)
    md = render_identity(res)
    print(md)
    for path, text in ((args.out_md, md), (args.out_json, json.dumps(res, indent=1))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
