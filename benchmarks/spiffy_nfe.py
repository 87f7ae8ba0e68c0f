"""NFE of block-diffusion decoding with and without Spiffy, side by side on the same prompts.

    python benchmarks/spiffy_nfe.py --model examples/fixtures/code-dllm \
        --prompts examples/fixtures/dev-prompts.jsonl --calib 32:48 --eval 0:8 \
        --max-new-tokens 256 --budgets 3 5 8 10 --out benchmarks/results/spiffy-nfe.json
Graphs are calibrated on the `--calib` slice of the prompts (the decoder runs once per rule; the
recorded chains serve every budget and both node selections) and evaluated on the disjoint
`--eval` slice. Every Spiffy row must reproduce its baseline's tokens exactly (checked).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench.common import DEV_PROMPTS, fixture, read_prompts, span, write_json
from transformers import AutoModelForCausalLM, AutoTokenizer

from spiffy_plugin.calibrate import calibration_chains, graph_from_chains, rule_name
from spiffy_plugin.decode import DecodeParams, generate
from spiffy_plugin.runtime import dllm_spec
from spiffy_plugin.spiffy import spiffy_generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(fixture("code-dllm")))
    p.add_argument("--prompts", default=str(DEV_PROMPTS))
    p.add_argument("--calib", default="32:48")
    p.add_argument("--eval", default="0:8")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--budgets", type=int, nargs="+", default=[3, 5, 8, 10])
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--selections", nargs="+", default=["expected-depth", "accumulated-frequency"])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    prompts = read_prompts(a.prompts)
    calib = [tok(x).input_ids for x in prompts[span(a.calib)]]
    evals = [tok(x).input_ids for x in prompts[span(a.eval)]]
    rows = []
    for rule in (DecodeParams(), DecodeParams(threshold=a.threshold)):
        name = "vanilla" if rule.threshold is None else f"threshold {rule.threshold}"
        t0 = time.perf_counter()
        base = [generate(model, x, rule, a.max_new_tokens) for x in evals]
        nfe0 = sum(r.nfe for r in base)
        toks = sum(len(r.tokens) for r in base)
        rows.append({"decoder": name, "D": None, "nfe": nfe0, "tokens": toks,
                     "tokens_per_forward": round(toks / nfe0, 3), "nfe_reduction": 1.0,
                     "identical": True, "seconds": round(time.perf_counter() - t0, 1)})
        print(rows[-1], flush=True)
        budgets = a.budgets if rule.threshold is None else [max(a.budgets)]
        chains = calibration_chains(model, calib, rule, a.max_new_tokens)
        for sel, d in [(sel, d) for sel in a.selections for d in budgets]:
            graph = graph_from_chains(chains, d, dllm_spec(model.config), rule_name(rule), sel)
            t0 = time.perf_counter()
            fast = [spiffy_generate(model, x, graph, rule, a.max_new_tokens) for x in evals]
            nfe = sum(r.nfe for r in fast)
            rows.append({"decoder": f"{name} + Spiffy", "selection": sel, "D": d, "nfe": nfe,
                         "tokens": toks, "tokens_per_forward": round(toks / nfe, 3),
                         "nfe_reduction": round(nfe0 / nfe, 3),
                         "nfe_reduction_vs_vanilla": round(rows[0]["nfe"] / nfe, 3),
                         "identical": [r.tokens for r in fast] == [r.tokens for r in base],
                         "max_depth": max(n.depth for n in graph.nodes),
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(rows[-1], flush=True)
    result = {"dtype": "float32", "calib": a.calib, "eval": a.eval,
              "max_new_tokens": a.max_new_tokens, "rows": rows}
    if a.out:
        write_json(a.out, result)


if __name__ == "__main__":
    main()
