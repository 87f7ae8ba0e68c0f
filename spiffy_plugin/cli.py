"""`spiffy` command line: `calibrate` (build a draft graph), `generate` (vanilla, threshold
or Spiffy decoding of one prompt, with NFE counts) and `convert-sdar` (a checkpoint for SGLang)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .errors import ConfigError, require, run_command
from .params import DecodeParams


def read_prompts(path: str) -> list[str]:
    p = Path(path)
    require(p.is_file(), "--prompts", f"file not found: {p}")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError("--prompts", f"{p}:{n} needs a JSON object with a 'prompt'")\
                    from None
    require(len(out) > 0, "--prompts", f"{p} holds no prompts")
    return out


def _load(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    require(Path(model_dir, "config.json").is_file(), "--model", f"no config.json in {model_dir}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tok


def _params(args) -> DecodeParams:
    return DecodeParams(unmask_per_step=args.unmask_per_step, threshold=args.threshold,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def cmd_calibrate(args) -> int:
    from .calibrate import calibrate

    require(args.budget >= 1, "--budget", f"must be >= 1, got {args.budget}")
    params = _params(args)
    prompts = read_prompts(args.prompts)[: args.limit]
    model, tok = _load(args.model)
    graph = calibrate(model, [tok(p).input_ids for p in prompts], args.budget, params,
                      args.max_new_tokens, args.max_depth, args.max_rank, args.selection)
    graph.save(args.out)
    print(f"wrote a draft graph of {len(graph.nodes)} nodes ({graph.rule}, "
          f"{graph.selection}) to {args.out}")
    return 0


def cmd_generate(args) -> int:
    from .decode import generate
    from .graph import load_graph
    from .spiffy import spiffy_generate

    params = _params(args)
    model, tok = _load(args.model)
    ids = tok(args.prompt).input_ids
    if args.graph:
        res = spiffy_generate(model, ids, load_graph(args.graph), params, args.max_new_tokens,
                              args.keep)
    else:
        res = generate(model, ids, params, args.max_new_tokens)
    print(args.prompt + tok.decode(res.tokens))
    print(f"-- tokens {len(res.tokens)}  NFE {res.nfe}  steps {res.steps}  "
          f"tokens/forward {res.tokens_per_forward:.2f}  stop {res.stop_reason}")
    return 0


def cmd_convert_sdar(args) -> int:
    from .engines.sdar import convert_to_sdar

    out = convert_to_sdar(args.model, args.out)
    print(f"wrote {out}: serve it with sglang.launch_server --dllm-algorithm ... (README 'SGLang')")
    return 0


def _decode_args(p) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--unmask-per-step", type=int, default=1)
    p.add_argument("--threshold", type=float, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spiffy", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="calibrate a draft graph on prompts")
    _decode_args(c)
    c.add_argument("--prompts", required=True)
    c.add_argument("--limit", type=int, default=None)
    c.add_argument("--budget", type=int, required=True, help="D: nodes in the graph")
    c.add_argument("--max-depth", type=int, default=6)
    c.add_argument("--selection", choices=["expected-depth", "accumulated-frequency"],
                   default="expected-depth", help="how the D nodes are chosen")
    c.add_argument("--max-rank", type=int, default=4)
    c.add_argument("--out", required=True)
    c.set_defaults(func=cmd_calibrate)
    g = sub.add_parser("generate", help="decode one prompt (Spiffy when --graph is given)")
    _decode_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--graph", default=None)
    g.add_argument("--keep", type=int, default=None, help="D*: nodes kept after pruning")
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("convert-sdar", help="write a copy SGLang serves as SDARForCausalLM")
    s.add_argument("--model", required=True)
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_convert_sdar)
    return run_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
