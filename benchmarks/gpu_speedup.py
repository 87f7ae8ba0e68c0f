"""DFlash wall-clock speedup on one GPU, every row side by side on the same prompts.

    python benchmarks/gpu_speedup.py --out out/gpu-speedup --compile --slow-limit 4   # H200, all
    python benchmarks/gpu_speedup.py --out out/gpu-cwi --compile --rows cold,warm,identity
    python benchmarks/gpu_speedup.py --plot out/gpu-speedup/results.json   # re-draw speedup.png
    python benchmarks/gpu_speedup.py --out out/gpu-adaptive --compile --rows adaptive \
        --batches 1 4 8 16 32 64                                  # adaptive speculation rows
(--attention sdpa|triton picks our runtime's attention; default auto = Triton on CUDA.)
Rows (greedy, EOS ignored so every request makes exactly --max-new-tokens tokens, bf16), by
--rows group: `batches`: plain AR, prompt lookup and DFlash (B = 8, 16) in our fast runtime
(static caches + CUDA graphs) at batch 1/4/16/32; `slow`: HF `generate` and the z-lab `dflash`
loop (PyPI dflash 0.1.0) at batch 1, ours re-timed on the same prompts; `warm`: batch-1 AR vs
DFlash after one full untimed pass over the same prompts; `adaptive`: at each --batches size,
plain AR vs fixed DFlash (B = 16) vs adaptive speculation (`fast_generate(adaptive=...)`, round
times measured after warmup) on the first batch x --adaptive-k dev prompts (cycled when fewer),
with the chosen-q histogram and token identity vs plain (`bench.fast_rows.adaptive_batch`);
`cold`: first-request latency in a fresh process with fresh Triton / inductor caches (AR and
DFlash B = 16, batch 1), prompt bucketing off (--prefill-bucket 0, the old runtime) and on (after
`FastDecoder.warmup()`);
`identity`: bf16 token identity of DFlash / n-gram vs plain decoding in the same runtime, with
the batch-invariant runtime (`invariant=True`) off and on; `fp32`: fp32 identity vs the
reference loop, HF and z-lab; `overhead`: per-round overhead vs isolated graph timings; `8b`: the
Qwen3-8B-shape projection (`bench/projection.py`); `tree`: greedy tree rounds (node budgets
16-128, B = 16) vs linear DFlash vs AR at batch 1 and 8 (`bench/tree_rows.py`). Every timed row
runs after `FastDecoder.warmup()` over its shapes (all padded prompt widths, or exactly its
prompts' widths with bucketing off; every block length). Every part runs in its own try/except.
Writes DIR/results.json, DIR/table.md, DIR/speedup.png (matplotlib when installed, else Pillow).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from bench.common import FIXTURES, attempt, checkout_first, run_info, write_json

checkout_first()

from bench.fast_rows import adaptive_markdown  # noqa: E402
from bench.plot import markdown, plot  # noqa: E402
from bench.reference_rows import (  # noqa: E402
    agreement_checks,
    fp32_checks,
    hf_rows,
    ours_on_slow_rows,
    zlab_rows,
)
from bench.speedup_rows import (  # noqa: E402
    Speedup,
    adaptive_rows,
    batch_rows,
    build_prompts,
    cold_rows,
    identity_rows,
    overhead_rows,
    projection_rows,
    warm_rows,
)
from bench.tree_rows import sampled_tree_rows, tree_rows  # noqa: E402

from dflash_plugin.adaptive import AdaptiveConfig  # noqa: E402
from dflash_plugin.checkpoint import load_drafter  # noqa: E402
from dflash_plugin.fast.accept import compile_steps  # noqa: E402
from dflash_plugin.loading import load_target  # noqa: E402

FIX = FIXTURES
GROUPS = ("batches", "slow", "warm", "cold", "identity", "fp32", "overhead", "8b", "tree",
          "adaptive")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", help="results folder (required unless --plot)")
    p.add_argument("--plot", metavar="RESULTS_JSON",
                   help="only re-draw speedup.png next to an earlier run's results.json")
    p.add_argument("--target", default=str(FIX / "code-target"))
    p.add_argument("--drafter", default=str(FIX / "code-target-dflash-b16"))
    p.add_argument("--prompts", default=str(FIX / "dev-prompts.jsonl"))
    p.add_argument("--limit", type=int, default=32, help="prompts for our runtime's rows")
    p.add_argument("--slow-limit", type=int, default=8,
                   help="prompts for HF generate / z-lab rows (batch 1; ours re-timed on them)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--quick", action="store_true", help="8 prompts, 2 slow, batches 1 4, 128 tok")
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--rows", default="all",
                   help=f"comma-separated groups of {','.join(GROUPS)} (default all)")
    p.add_argument("--device", default="cuda", help="cpu: a slow fp32 smoke test of the script")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile our elementwise ops and the acceptance step "
                   "(fast.accept.compile_steps)")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "triton"],
                   help="attention backend of our runtime's steps (fast/attention.py)")
    p.add_argument("--prefill-bucket", type=int, default=64,
                   help="pad prompts to a multiple of this (0 = off, the old runtime)")
    p.add_argument("--invariant", action="store_true",
                   help="timed rows use the batch-invariant runtime (identity rows run both)")
    p.add_argument("--adaptive-k", type=int, default=8,
                   help="`adaptive` rows: batch x k dev prompts per batch size (--prompts file)")
    p.add_argument("--adaptive-reads-every", type=int, default=AdaptiveConfig().reads_every,
                   help="`adaptive` rows: most rounds at q > 1 between host reads (policy "
                   "updates); the H200 rows of 2026-12-01 used 8")
    p.add_argument("--cold-prompts", type=int, default=4,
                   help="never-seen prompt lengths timed per cold row")
    p.add_argument("--cold-timeout", type=int, default=400, help="seconds per cold process")
    p.add_argument("--tree-batches", type=int, nargs="+", default=[1, 8],
                   help="`tree` rows: batch sizes")
    p.add_argument("--tree-budgets", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="`tree` rows: node budgets (plus the linear draft), B = 16")
    p.add_argument("--tree-topk", type=int, default=4, help="`tree` rows: top-k per depth")
    p.add_argument("--tree-8b", action="store_true",
                   help="`tree` rows: also the round cost per budget at the Qwen3-8B shape "
                        "(random weights) and the speedup it implies at the measured taus")
    p.add_argument("--tree-temperature", type=float, default=0.0,
                   help="`tree` rows: > 0 adds sampled rows (chain vs budgets) at this T")
    args = p.parse_args()
    if args.plot:
        print(plot(args.plot, Path(args.plot).with_name("speedup.png")))
        return
    if not args.out:
        p.error("--out is required")
    groups = set(GROUPS) if args.rows == "all" else set(args.rows.split(","))
    if groups - set(GROUPS):
        p.error(f"--rows: unknown {sorted(groups - set(GROUPS))}; groups: {GROUPS}")
    if args.compile:
        compile_steps()
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.quick:
        args.limit, args.slow_limit, args.batches, args.max_new_tokens = 8, 2, [1, 4], 128
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    R = {"run": run_info(device), "dtype": str(dtype), "args": vars(args),
         "rows": [], "checks": {}, "errors": {}, "warmup_seconds": {},
         "partial_path": str(out_dir / "results.partial.json")}
    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    model, tok = load_target(args.target, device, dtype)
    drafter = load_drafter(args.drafter, device, dtype)
    prompts = build_prompts(tok, args.prompts, args.limit)
    N = args.max_new_tokens
    width = max(len(x) for x in prompts)
    S = Speedup(R, args, device, model, drafter, tok, prompts, prompts[: args.slow_limit], N,
                width, width + N + 16)

    if "cold" in groups:  # first-request latency in fresh processes (bench/speedup_rows.py)
        attempt(R, "cold first-request latency", lambda: cold_rows(S))
    if "warm" in groups:
        attempt(R, "warm batch 1", lambda: warm_rows(S))
    if "identity" in groups:
        attempt(R, "bf16 identity", lambda: identity_rows(S))
    for batch in args.batches if "adaptive" in groups else []:
        attempt(R, f"adaptive b{batch}", lambda batch=batch: adaptive_rows(S, batch))
    for batch in args.batches if "batches" in groups else []:
        batch_rows(S, batch)  # AR, n-gram, DFlash: each in its own attempt
    if "slow" in groups:  # HF generate and the z-lab loop (bench/reference_rows.py)
        attempt(R, "HF generate b1", lambda: hf_rows(S))
        attempt(R, "z-lab dflash b1", lambda: zlab_rows(S))
        attempt(R, "ours on the HF/z-lab prompts", lambda: ours_on_slow_rows(S))
    attempt(R, "bf16 agreement", lambda: agreement_checks(S))
    if "fp32" in groups:
        attempt(R, "fp32 identity", lambda: fp32_checks(S))
    if "overhead" in groups and "batches" in groups:
        attempt(R, "round overhead", lambda: overhead_rows(S))
    if "tree" in groups:  # tree rounds vs linear DFlash vs AR (bench/tree_rows.py)
        attempt(R, "tree rounds", lambda: tree_rows(R, model, drafter, prompts, N, S.max_len,
                                                     args, S.add_row))
        if args.tree_temperature > 0:
            attempt(R, "sampled tree rounds", lambda: sampled_tree_rows(
                R, model, drafter, prompts, N, S.max_len, args, S.add_row))
    if not args.skip_8b and device == "cuda" and "8b" in groups:
        attempt(R, "8B projection", lambda: projection_rows(S))

    R["wall_seconds"] = time.perf_counter() - t_start
    write_json(out_dir / "results.json", R)
    table = markdown(R) + adaptive_markdown(R.get("adaptive", []))
    (out_dir / "table.md").write_text(table)
    print(table)
    attempt(R, "plot", lambda: plot(out_dir / "results.json", out_dir / "speedup.png"))
    write_json(out_dir / "results.json", R)
    print(f"wrote {out_dir} in {R['wall_seconds']:.0f} s; errors: {list(R['errors'])}")


if __name__ == "__main__":
    main()
