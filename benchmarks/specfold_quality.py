"""SpecFold's task quality (issue 21, part 1): vanilla, Spiffy and SpecFold per delta on held-out
prompts, judged without token identity (`specfold_plugin.quality`): (a) parse rate, (b) mean
per-token log-likelihood under the autoregressive judge, (c) first-line exact match vs vanilla;
each with a 95 % percentile bootstrap CI over prompts (and paired differences vs Spiffy).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/specfold_quality.py --eval 0:32 \
        --max-new-tokens 128 --budget 10 --max-minutes 25 \
        --out benchmarks/results/specfold-quality

The graph is calibrated on `--calib` (32:40, as specfold_bench). Prompts run in order, every
decoder per prompt; `--max-minutes` stops before the next prompt once exceeded (the JSON names
the prompts done). Writes `--out`/quality.json after every prompt; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import (
    DEV_PROMPTS,
    checkout_first,
    fixture,
    read_prompts,
    run_info,
    span,
    write_json,
)

checkout_first()  # this checkout's packages, not an installed copy

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from specfold_plugin.quality import (  # noqa: E402
    bootstrap_ci,
    completion_parses,
    first_line,
    judge_loglik,
    parse_status,
)
from specfold_plugin.specfold import agreement_summary, specfold_generate  # noqa: E402
from spiffy_plugin.calibrate import calibrate  # noqa: E402
from spiffy_plugin.decode import DecodeParams, generate  # noqa: E402
from spiffy_plugin.spiffy import spiffy_generate  # noqa: E402


def decoders(graph, deltas, params, max_new):
    yield "vanilla", lambda m, x: generate(m, x, params, max_new)
    yield "spiffy", lambda m, x: spiffy_generate(m, x, graph, params, max_new)
    for d in deltas:
        yield f"specfold-{d:g}", lambda m, x, d=d: specfold_generate(m, x, graph, params, max_new,
                                                                     delta=d)


def score(tok, judge, prompt, ids, res, eos):
    text_ids = [t for t in res.tokens if t != eos]
    text = tok.decode(text_ids)
    ended = res.stop_reason == "eos"
    return {"tokens": res.tokens, "nfe": res.nfe, "stop": res.stop_reason, "text": text,
            "parses": completion_parses(prompt, text, ended),
            "judge_loglik": judge_loglik(judge, ids, res.tokens),
            "first_line": first_line(text)}


def ci(values, a):
    m, lo, hi = bootstrap_ci([float(v) for v in values], a.resamples, 0.95, a.seed)
    return {"mean": round(m, 4), "lo": round(lo, 4), "hi": round(hi, 4)}


def summarize(rows, names, a):
    ref, spiffy = rows["vanilla"], rows["spiffy"]
    out = {}
    for n in names:
        r = rows[n]
        out[n] = {
            "prompts": len(r), "nfe": sum(x["nfe"] for x in r),
            "parse_rate": ci([x["parses"] for x in r], a),
            "judge_loglik": ci([x["judge_loglik"] for x in r], a),
            "first_line_match": ci([x["first_line"] == v["first_line"]
                                    for x, v in zip(r, ref)], a),
            "parse_diff_vs_spiffy": ci([x["parses"] - s["parses"] for x, s in zip(r, spiffy)], a),
            "judge_diff_vs_spiffy": ci([x["judge_loglik"] - s["judge_loglik"]
                                        for x, s in zip(r, spiffy)], a),
            **agreement_summary([x["tokens"] for x in r], [s["tokens"] for s in spiffy])}
    return out


def within(value, c):
    return c["lo"] <= value <= c["hi"]


def goal(summary, delta=0.1):
    sf, sp = summary.get(f"specfold-{delta:g}"), summary["spiffy"]
    if sf is None:
        return None
    ok = {k: within(sf[k]["mean"], sp[k]) for k in ("parse_rate", "judge_loglik")}
    return {"delta": delta, **ok, "met": all(ok.values())}


def fmt(c, pct=False):
    s = 100 if pct else 1
    f = "{:.1f}" if pct else "{:.3f}"
    return f"{f.format(c['mean'] * s)} [{f.format(c['lo'] * s)}, {f.format(c['hi'] * s)}]"


def table(summary) -> str:
    lines = ["| decoder | parse rate % [95 % CI] | judge log-lik, nats/token [95 % CI] | "
             "first line = vanilla % [95 % CI] | judge diff vs Spiffy [95 % CI] | "
             "token agreement w/ Spiffy | NFE |", "|---|---|---|---|---|---|---|"]
    for n, s in summary.items():
        lines.append(f"| {n} | {fmt(s['parse_rate'], True)} | {fmt(s['judge_loglik'])} | "
                     f"{fmt(s['first_line_match'], True)} | {fmt(s['judge_diff_vs_spiffy'])} | "
                     f"{100 * s['agreement']:.1f} % | {s['nfe']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(fixture("code-dllm")), help="block-diffusion LM")
    p.add_argument("--judge", default=str(fixture("code-target")), help="autoregressive judge")
    p.add_argument("--prompts", default=str(DEV_PROMPTS))
    p.add_argument("--calib", default="32:40")
    p.add_argument("--eval", default="0:32")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=10, help="D: draft graph nodes")
    p.add_argument("--deltas", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3])
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--out", required=True, help="folder for quality.json")
    a = p.parse_args()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.model)
    jtok = AutoTokenizer.from_pretrained(a.judge)
    if tok.get_vocab() != jtok.get_vocab():  # then completions would need re-tokenizing
        raise SystemExit("the judge's tokenizer differs from the model's")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    judge = AutoModelForCausalLM.from_pretrained(a.judge, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    prompts = read_prompts(a.prompts)
    calib = [tok(x).input_ids for x in prompts[span(a.calib)]]
    every = list(range(len(prompts)))
    idx = every[span(a.eval)]
    if set(idx) & set(every[span(a.calib)]):
        raise SystemExit("--eval overlaps --calib")
    params = DecodeParams()
    graph = calibrate(model, calib, a.budget, params, a.max_new_tokens)
    names = [n for n, _ in decoders(graph, a.deltas, params, a.max_new_tokens)]
    rows = {n: [] for n in names}
    import spiffy_plugin

    result = {"run": run_info(torch.device("cpu")), "dtype": "float32", "args": vars(a),
              "package_dir": str(Path(spiffy_plugin.__file__).parent.parent),
              "graph_nodes": len(graph.nodes), "calibration_s": round(time.perf_counter() - t0)}
    out = Path(a.out)
    done = []
    for i in idx:
        if a.max_minutes is not None and time.perf_counter() - t0 > 60 * a.max_minutes:
            break
        prompt = prompts[i]
        ids = tok(prompt).input_ids
        for n, fn in decoders(graph, a.deltas, params, a.max_new_tokens):
            rows[n].append({"prompt": i, **score(tok, judge, prompt, ids, fn(model, ids), eos)})
        done.append(i)
        result.update(prompts_done=done, prompt_parse_status={
            str(j): parse_status(prompts[j]) for j in done},
            seconds=round(time.perf_counter() - t0), summary=summarize(rows, names, a),
            rows=rows)
        result["goal"] = goal(result["summary"])
        write_json(out / "quality.json", result)
        print(json.dumps({"prompt": i, "seconds": result["seconds"]}), flush=True)
    print(table(result["summary"]))
    print(json.dumps({"goal": result["goal"]}))
    print(f"wrote {out / 'quality.json'}")


if __name__ == "__main__":
    main()
