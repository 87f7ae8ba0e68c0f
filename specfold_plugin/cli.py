"""`specfold generate`: Spiffy decoding of one prompt with folded verification (delta = the
relative-residual threshold); `--compare` also runs Spiffy (dense verification) and reports the
token agreement. Draft graphs come from `spiffy calibrate`."""

from __future__ import annotations

import argparse
import sys

from spiffy_plugin.cli import _decode_args, _load, _params
from spiffy_plugin.errors import run_command

from .gate import check_delta
from .specfold import BACKENDS, CAPACITIES, DEFAULT_DELTA, specfold_generate, token_agreement
from .stats import projected_flops


def cmd_generate(args) -> int:
    from spiffy_plugin.graph import load_graph
    from spiffy_plugin.runtime import dllm_spec
    from spiffy_plugin.spiffy import spiffy_generate

    check_delta(args.delta)
    params = _params(args)
    graph = load_graph(args.graph)
    model, tok = _load(args.model)
    ids = tok(args.prompt).input_ids
    res = specfold_generate(model, ids, graph, params, args.max_new_tokens, args.keep,
                            args.delta, args.ffn_gate, args.backend, args.capacity)
    print(args.prompt + tok.decode(res.tokens))
    print(f"-- tokens {len(res.tokens)}  NFE {res.nfe}  steps {res.steps}  "
          f"tokens/forward {res.tokens_per_forward:.2f}  stop {res.stop_reason}")
    if res.fold is not None:
        s = res.fold.summary()
        flops = projected_flops(model.config, res.fold, dllm_spec(model.config).block_size)
        print(f"-- delta {args.delta}  folded rows: QKV {s['fold_qkv']:.1%}  FFN "
              f"{s['fold_ffn']:.1%} (drafts only: {s['fold_qkv_drafts']:.1%} / "
              f"{s['fold_ffn_drafts']:.1%})  projected verify FLOP saving {flops['saving']:.1%}")
    if args.compare:
        ref = spiffy_generate(model, ids, graph, params, args.max_new_tokens, args.keep)
        same, total = token_agreement(res.tokens, ref.tokens)
        print(f"-- vs Spiffy: {same}/{total} tokens agree ({same / max(total, 1):.1%}), "
              f"Spiffy NFE {ref.nfe}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specfold", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="decode one prompt with folded verification")
    _decode_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--graph", required=True, help="draft graph from `spiffy calibrate`")
    g.add_argument("--keep", type=int, default=None, help="D*: nodes kept after pruning")
    g.add_argument("--delta", type=float, default=DEFAULT_DELTA,
                   help="fold threshold on the relative residual (0 = exact)")
    g.add_argument("--ffn-gate", choices=("own", "layer"), default="own",
                   help="gate the FFN on its own input (default) or reuse the layer's gate")
    g.add_argument("--backend", choices=BACKENDS, default="torch",
                   help="folded forward: torch reference or the Triton kernels (CPU: set "
                   "TRITON_INTERPRET=1)")
    g.add_argument("--capacity", choices=CAPACITIES, default="sync",
                   help="kernel backend: size compact batches from each gate's true count (sync, "
                   "a host read per gate) or from recent counts (plan, CUDA-graph friendly)")
    g.add_argument("--compare", action="store_true", help="also run Spiffy; print agreement")
    g.set_defaults(func=cmd_generate)
    return run_command(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
