"""The command line and the run records the engine benchmarks share (`gpu_engines.py`,
`gpu_sampling.py`): engine options, the engine to start from them (`engine_spec`), the dev
prompts as token ids, and the header every result JSON opens with."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from bench.engine_rows import EngineSpec, engine_env, gpu_name

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "examples" / "fixtures"
SPEC_MODES = ("dflash", "tuned", "tree", "adaptive-q1")  # the modes that load the drafter
TUNE_SGLANG = ROOT / "benchmarks" / "results" / "gpu-engines" / "tune-sglang.json"


def draft_of(args) -> str | None:
    """The drafter a run loads: --draft in a speculative mode, None for plain decoding."""
    return args.draft if args.mode in SPEC_MODES else None


def prompt_ids(args) -> list[list[int]]:
    """The first --num-prompts prompts as token ids, left-truncated so that prompt + new tokens
    (+ one draft block) fit max-model-len."""
    from transformers import AutoTokenizer

    from dflash_plugin.training.data import load_prompts_jsonl

    tok = AutoTokenizer.from_pretrained(args.target)
    keep = args.max_model_len - args.max_tokens - args.num_spec_tokens - 8
    prompts = load_prompts_jsonl(args.prompts)[: args.num_prompts]
    return [tok(p).input_ids[-keep:] for p in prompts]


def tuned_config(path: str) -> dict | None:
    """The `--speculative-config` a `dflash tune --engine vllm` report recommends for a mixed
    load: its per-batch-size table (a fixed config when one k fits all; None = plain)."""
    return json.loads(Path(path).read_text())["vllm"]["speculative_config_table"]


def q1_config(report: Path, out_dir: Path) -> Path:
    """A copy of a `dflash tune --engine sglang` report with its plain (k = 0) cells only, in
    `out_dir`: DFLASH_ADAPTIVE given it knows only plain step times, so every decode step is
    its q = 1 step (what a plain step costs inside the DFLASH worker)."""
    doc = json.loads(Path(report).read_text())
    doc["cells"] = [c for c in doc["cells"] if c["k"] == 0]
    out = Path(out_dir) / "q1-config.json"
    out.write_text(json.dumps(doc))
    return out


def engine_spec(args, target: str, draft: str | None, **kw) -> EngineSpec:
    if getattr(args, "mode", None) == "tree":
        if args.engine != "sglang":
            sys.exit("--mode tree needs --engine sglang (vLLM has no tree verification hook)")
        kw["tree_topk"] = args.tree_topk
        kw["draft_attention_backend"] = args.draft_attention_backend
        if os.environ.get("DFLASH_TREE_PROFILE"):  # its lines log at info (Engine's: error)
            kw["log_level"] = "info"
    if getattr(args, "mode", None) == "adaptive-q1":
        if args.engine != "sglang":
            sys.exit("--mode adaptive-q1 needs --engine sglang (DFLASH_ADAPTIVE is ours there)")
        kw["adaptive_config"] = str(q1_config(args.adaptive_config,
                                              Path(tempfile.mkdtemp(prefix="q1-config-"))))
    if getattr(args, "attention_backend", None):
        kw["attention_backend"] = args.attention_backend
    if getattr(args, "mode", None) == "tuned":
        kw["speculative_config"] = tuned_config(args.tuned)
        draft = None if kw["speculative_config"] is None else draft
    return EngineSpec(engine=args.engine, target=target, draft=draft,
                      num_spec_tokens=args.num_spec_tokens, dtype=args.dtype,
                      max_model_len=args.max_model_len, seed=args.seed,
                      enforce_eager=args.enforce_eager, prefix_caching=args.prefix_caching,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      prefill_graphs=not args.no_prefill_graphs, tp=args.tp, **kw)


def header(args, runner, kind: str) -> dict:
    return {"kind": kind, "engine": args.engine, "engine_version": runner.version,
            "mode": args.mode, "tp": args.tp, "dtype": args.dtype,
            "num_spec_tokens": args.num_spec_tokens, "device": gpu_name(), "env": engine_env(),
            **({"tree_topk": args.tree_topk} if args.mode == "tree" else {}),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "python": sys.version.split()[0]}


def write(doc: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))


def engine_args(q) -> None:
    """The engine options every subcommand takes (also `gpu_sampling.py`'s)."""
    q.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    q.add_argument("--mode", choices=("plain", "dflash", "tuned", "tree", "adaptive-q1"),
                   required=True,
                   help="tuned (vLLM): the --speculative-config of a dflash tune report; "
                   "tree (SGLang): our DFLASH_TREE, node budget --num-spec-tokens; adaptive-q1 "
                   "(SGLang): our DFLASH_ADAPTIVE with every decode step at q = 1 (its plain "
                   "step)")
    q.add_argument("--adaptive-config", default=str(TUNE_SGLANG),
                   help="--mode adaptive-q1: a dflash tune --engine sglang report (its k = 0 "
                   "cells are used)")
    q.add_argument("--tree-topk", type=int, default=4, help="--mode tree: top-K per depth")
    q.add_argument("--draft-attention-backend", choices=("flashinfer", "fa3", "triton"),
                   help="--mode tree: the drafter's (default: the target's, flashinfer)")
    q.add_argument("--attention-backend", choices=("flashinfer", "fa3", "triton"),
                   help="SGLang: target and drafter (--mode tree: flashinfer; fa3 needs "
                   "--tree-topk > 1)")
    q.add_argument("--tuned", default=None, help="dflash tune report JSON (--mode tuned)")
    q.add_argument("--prompts", default=str(FIX / "dev-prompts.jsonl"))
    q.add_argument("--dtype", default="bfloat16")
    q.add_argument("--num-spec-tokens", type=int, default=15, help="draft tokens per round")
    q.add_argument("--max-model-len", type=int, default=4096)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (vLLM enforce_eager, SGLang disable_cuda_graph)")
    q.add_argument("--prefix-caching", action="store_true")
    q.add_argument("--no-prefill-graphs", action="store_true",
                   help="SGLang: no prefill CUDA graphs (decode graphs stay)")
    q.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM gpu_memory_utilization / SGLang mem_fraction_static")
    q.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel GPUs (vLLM tensor_parallel_size, SGLang tp_size)")
    q.add_argument("--out", required=True, help="JSON file to write")


def prompt_run_args(r, num_prompts: int, max_tokens: int) -> None:
    """engine_args plus the pair and the prompts of a run over the fixture's dev prompts."""
    engine_args(r)
    r.add_argument("--target", default=str(FIX / "code-target"))
    r.add_argument("--draft", default=str(FIX / "code-target-dflash-b16"))
    r.add_argument("--num-prompts", type=int, default=num_prompts)
    r.add_argument("--max-tokens", type=int, default=max_tokens)
