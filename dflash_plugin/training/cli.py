"""`dflash make-data` and `dflash train` subcommands."""

from __future__ import annotations

import json

from ..errors import require, validated


def cmd_make_data(args) -> int:
    from ..loading import DTYPES, load_target
    from .data import code_files, cut_code_prompts, load_prompts_jsonl, make_data

    require(bool(args.prompts) != bool(args.code_dir), "--prompts/--code-dir",
            "give exactly one source of prompts")
    if args.prompts:
        prompts = load_prompts_jsonl(args.prompts)
    else:
        files = code_files(args.code_dir, exclude=tuple(args.exclude))
        require(len(files) > 0, "--code-dir", f"no usable *.py files under {args.code_dir}")
        prompts = cut_code_prompts(files, args.prompts_per_file, args.seed)
    if args.max_prompts:
        prompts = prompts[:args.max_prompts]
    model, tok = load_target(args.target, args.device, DTYPES[args.dtype])
    make_data(model, tok, prompts, args.out, max_new_tokens=args.max_new_tokens,
              temperature=args.temperature, top_p=args.top_p, shard_size=args.shard_size,
              batch_size=args.batch_size, seed=args.seed, fast=args.fast)
    print(f"wrote continuations of {len(prompts)} prompts to {args.out}")
    return 0


def cmd_train(args) -> int:
    from ..loading import DTYPES, load_target
    from .trainer import TrainConfig, train

    fields = {k: v for k, v in vars(args).items()
              if k in TrainConfig.model_fields and v is not None}
    dtype = DTYPES["bfloat16" if args.device.startswith("cuda") else "float32"]
    model, tok = load_target(args.target, args.device, dtype)
    if fields.get("mask_token_id") is None and getattr(tok, "mask_token_id", None) is not None:
        fields["mask_token_id"] = tok.mask_token_id
    cfg = validated(TrainConfig, **fields)
    summary = train(cfg, model, args.device)
    print(json.dumps({k: v for k, v in summary.items() if k != "loss_history"}, indent=2))
    return 0


def add_parsers(sub, default_device: str) -> None:
    from .data import HELD_OUT

    m = sub.add_parser("make-data", help="target continuations of prompts, as token shards")
    m.add_argument("--target", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--prompts", help="JSONL file with a 'prompt' field per line")
    m.add_argument("--code-dir", nargs="*", default=None, help="cut prompts from *.py files")
    m.add_argument("--exclude", nargs="*", default=list(HELD_OUT))
    m.add_argument("--prompts-per-file", type=int, default=2)
    m.add_argument("--max-prompts", type=int, default=None)
    m.add_argument("--max-new-tokens", type=int, default=256)
    m.add_argument("--temperature", type=float, default=0.0)
    m.add_argument("--top-p", type=float, default=1.0)
    m.add_argument("--shard-size", type=int, default=1024)
    m.add_argument("--batch-size", type=int, default=64)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device", default=default_device)
    m.add_argument("--dtype", default="float32")
    m.add_argument("--fast", action="store_true",
                   help="greedy generation with the static-cache runtime (CUDA graphs on GPU)")
    m.set_defaults(func=cmd_make_data)

    t = sub.add_parser("train", help="train a DFlash drafter (random anchors, decaying weights)")
    t.add_argument("--target", required=True)
    t.add_argument("--data", nargs="+", required=True)
    t.add_argument("--out", required=True)
    for name, typ in [("num-layers", int), ("block-size", int), ("gamma", float),
                      ("num-anchors", int), ("max-seq-len", int), ("batch-size", int),
                      ("grad-accum", int), ("lr", float), ("min-lr-ratio", float),
                      ("warmup-steps", int), ("max-steps", int), ("time-budget-minutes", float),
                      ("weight-decay", float), ("clip", float), ("seed", int),
                      ("save-every", int), ("log-every", int), ("mask-token-id", int),
                      ("init-from", str), ("steps-this-run", int)]:
        t.add_argument(f"--{name}", type=typ, default=None)
    t.add_argument("--init-from-target", action="store_true", default=None)
    t.add_argument("--packed-attention", choices=["expand", "dense"], default=None)
    t.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the drafter's elementwise ops (faster on GPU)")
    t.add_argument("--device", default=default_device)
    t.set_defaults(func=cmd_train)
