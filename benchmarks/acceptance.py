"""Acceptance length (tau) of drafters and prompt lookup on a prompt set, side by side.

Every configuration runs the same prompts through the reference runtime in one process:
    python benchmarks/acceptance.py [--target DIR] --drafter NAME=DIR ... [--prompts FILE] \
        --max-new-tokens 256 --block-sizes 16 8 --temperatures 0 1 --out results.json
`--trees 32:4 64:4` adds tree-drafting rows (node budget : top-k per depth) for every drafter.
Greedy rows are also checked for token identity against the prompt-lookup rows (all configs
must produce the same text at temperature 0, since every one of them is lossless).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench.common import DEV_PROMPTS, fixture, read_prompts, run_info, write_json

from dflash_plugin.checkpoint import check_compatible, load_drafter
from dflash_plugin.cli import stop_ids
from dflash_plugin.generate import speculative_generate
from dflash_plugin.loading import DTYPES, load_target
from dflash_plugin.metrics import AggregateMetrics
from dflash_plugin.ngram import NgramProposer
from dflash_plugin.proposers import DFlashProposer
from dflash_plugin.sampling import SamplingParams
from dflash_plugin.tree_generate import tree_generate


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    model, tok = load_target(args.target, args.device, dtype)
    prompts = [tok(p).input_ids for p in read_prompts(args.prompts)][: args.limit]
    drafters = {}
    for spec in args.drafter:
        name, path = spec.split("=", 1)
        drafters[name] = load_drafter(path, args.device, dtype)
        check_compatible(drafters[name].config, model.config)
    stops = () if args.ignore_eos else stop_ids(model, tok)
    rows, outputs = [], {}
    for temp in args.temperatures:
        for bs in args.block_sizes:
            names = [(n, None) for n in drafters] + ([("ngram", None)] if args.ngram else [])
            names += [(n, t) for n in drafters for t in args.trees]
            for name, tree in names:
                proposer = NgramProposer() if name == "ngram" else DFlashProposer(drafters[name])
                params = SamplingParams(temperature=temp, seed=args.seed)
                toks, requests = [], []
                t0 = time.perf_counter()
                for i in range(0, len(prompts), args.batch_size):
                    kw = dict(block_size=bs, max_new_tokens=args.max_new_tokens, params=params,
                              stop_token_ids=stops)
                    batch = prompts[i:i + args.batch_size]
                    if tree is None:
                        res = speculative_generate(model, proposer, batch, **kw)
                    else:
                        budget, topk = map(int, tree.split(":"))
                        res = tree_generate(model, proposer, batch, tree_budget=budget,
                                            tree_topk=topk, **kw)
                    toks += res.tokens
                    requests += res.metrics.requests
                agg = AggregateMetrics(requests)
                tau = agg.tau
                name = name if tree is None else f"{name} tree {tree}"
                row = {"proposer": name, "block_size": bs, "temperature": temp,
                       "tau": round(tau, 3), "tau_per_prompt": [round(r.tau, 3) for r in requests],
                       "per_position_acceptance": [round(a, 4) for a in
                                                   agg.per_position_acceptance],
                       "new_tokens": agg.new_tokens, "rounds": agg.rounds,
                       "wall_seconds": round(time.perf_counter() - t0, 2)}
                rows.append(row)
                outputs[(name, bs, temp)] = toks
                print(f"T={temp} B={bs} {name:>10}: tau {tau:.3f}  ({row['wall_seconds']} s)",
                      flush=True)
    greedy = [v for (n, b, t), v in outputs.items() if t == 0]
    identical = all(g == greedy[0] for g in greedy)
    return {"run": run_info(args.device), "dtype": args.dtype, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "greedy_outputs_identical_across_proposers": identical, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default=str(fixture("code-target")))
    p.add_argument("--drafter", nargs="*", default=[], help="NAME=DIR")
    p.add_argument("--ngram", action="store_true", help="also measure prompt lookup")
    p.add_argument("--trees", nargs="*", default=[], metavar="BUDGET:TOPK",
                   help="tree-drafting rows for every drafter, e.g. 32:4 64:4")
    p.add_argument("--prompts", default=str(DEV_PROMPTS))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 8])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = run(args)
    if args.out:
        write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
