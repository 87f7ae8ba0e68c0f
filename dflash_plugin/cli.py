"""`dflash` command line: `generate` (speculative generation with a drafter), `init-draft` (a
randomly initialised drafter for a target, z-lab format), `make-data` and `train` (the recipe),
`tune` (drafted tokens per concurrency, measured in a serving engine, as that engine's config)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .checkpoint import (
    check_compatible,
    config_for_target,
    init_drafter,
    load_drafter,
    save_drafter,
)
from .errors import ConfigError, require
from .generate import speculative_generate
from .loading import DTYPES, load_target
from .proposers import DFlashProposer
from .sampling import SamplingParams
from .tree_generate import tree_generate


def stop_ids(model, tok) -> tuple[int, ...]:
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return tuple(sorted(ids))


def _plain_baseline(model, prompt_ids, max_new, stops, params) -> tuple[list[int], float]:
    """Plain (non-speculative) greedy decoding of the same target, for the lossless check."""
    t0 = time.perf_counter()
    out = model.generate(torch.tensor([prompt_ids], device=model.device), do_sample=False,
                         max_new_tokens=max_new, eos_token_id=list(stops) or None,
                         pad_token_id=model.config.pad_token_id or 0,
                         **({} if stops else {"min_new_tokens": max_new}))
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0


def cmd_generate(args) -> int:
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    dtype = DTYPES[args.dtype]
    model, tok = load_target(args.target, args.device, dtype)
    drafter = load_drafter(args.draft, args.device, dtype)
    check_compatible(drafter.config, model.config)
    block = args.block_size or drafter.config.block_size
    prompt_ids = tok(args.prompt).input_ids
    require(len(prompt_ids) > 0, "--prompt", "is empty")
    stops = () if args.ignore_eos else stop_ids(model, tok)
    require(args.tree_budget >= 0, "--tree-budget", f"must be >= 0 (0 = linear drafting), got "
            f"{args.tree_budget}")
    if args.tree_budget:  # the reference runtime's tree loop (no fast path yet)
        res = tree_generate(model, DFlashProposer(drafter), [prompt_ids],
                            tree_budget=args.tree_budget, tree_topk=args.tree_topk,
                            block_size=block, max_new_tokens=args.max_new_tokens, params=params,
                            stop_token_ids=stops)
    else:
        res = speculative_generate(model, DFlashProposer(drafter), [prompt_ids],
                                   block_size=block, max_new_tokens=args.max_new_tokens,
                                   params=params, stop_token_ids=stops,
                                   fast=False if args.reference else None)
    tokens = res.tokens[0]
    report = {"completion": tok.decode(tokens), "block_size": block, **res.metrics.to_dict()}
    if args.baseline:
        ref, secs = _plain_baseline(model, prompt_ids, args.max_new_tokens, stops, params)
        report["baseline"] = {"tokens_per_second": len(ref) / secs, "seconds": secs}
        if params.greedy:
            report["baseline"]["token_identical"] = ref == tokens
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(args.prompt + report["completion"])
    print("-" * 60)
    print(f"new tokens {report['new_tokens']}  rounds {report['rounds']}  "
          f"tau {report['tau']:.2f}  block {block}")
    print("per-position acceptance:", " ".join(f"{x:.2f}" for x in
                                               report["per_position_acceptance"]))
    print(f"time: prefill {report['prefill_seconds']:.3f}s  draft {report['draft_seconds']:.3f}s"
          f"  verify {report['verify_seconds']:.3f}s  total {report['total_seconds']:.3f}s  "
          f"({report['tokens_per_second']:.1f} tok/s)")
    if "baseline" in report:
        b = report["baseline"]
        ident = b.get("token_identical")
        print(f"plain decoding: {b['tokens_per_second']:.1f} tok/s"
              + ("" if ident is None else f"; speculative output token-identical: {ident}"))
    return 0


def cmd_init_draft(args) -> int:
    from transformers import AutoConfig, AutoTokenizer

    tcfg = AutoConfig.from_pretrained(args.target)
    mask = args.mask_token_id
    if mask is None:
        mask = getattr(tcfg, "mask_token_id", None)
    if mask is None:
        mask = AutoTokenizer.from_pretrained(args.target).mask_token_id
    cfg = config_for_target(tcfg, num_layers=args.layers, block_size=args.block_size,
                            mask_token_id=mask)
    out = save_drafter(init_drafter(cfg, seed=args.seed), args.out)
    print(f"wrote a random {args.layers}-layer drafter (block {args.block_size}, target layers "
          f"{list(cfg.target_layer_ids)}) to {out}")
    return 0


def cmd_tune(args) -> int:
    from .tune import request_from_args, write_report

    req = request_from_args(args)  # every argument checked before an engine starts
    if req.engine == "vllm":
        from .engines.vllm_tune import run
    else:
        from .engines.sglang_tune import run
    print(write_report(run(req), req.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="speculative generation with a DFlash drafter")
    g.add_argument("--target", required=True, help="Hugging Face target model folder")
    g.add_argument("--draft", required=True, help="DFlash drafter folder (z-lab format)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--baseline", action="store_true",
                   help="also run plain decoding and report its speed and token identity")
    g.add_argument("--json", action="store_true")
    g.add_argument("--tree-budget", type=int, default=0,
                   help="tree drafting: draft nodes verified per round (0 = a linear draft)")
    g.add_argument("--tree-topk", type=int, default=4, help="tree drafting: candidates per depth")
    g.add_argument("--reference", action="store_true",
                   help="force the reference loop (default on CUDA: the fast graph runtime)")
    g.set_defaults(func=cmd_generate)
    d = sub.add_parser("init-draft", help="write a randomly initialised drafter for a target")
    d.add_argument("--target", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--layers", type=int, default=1)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--mask-token-id", type=int, default=None)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_init_draft)
    from .tune import add_parser as add_tune_parser

    add_tune_parser(sub).set_defaults(func=cmd_tune)
    from .training.cli import add_parsers

    add_parsers(sub, "cuda" if torch.cuda.is_available() else "cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
