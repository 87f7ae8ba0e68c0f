"""Per-round cost of the fast runtime's DFlash loop at batch 1, split vs fused round graphs.

    python benchmarks/round_overhead_bench.py --out DIR [--drafter DIR] [--compile]

*split*: a round replays three CUDA graphs (draft, verify, accept); *fused*: one graph per
round (`FastDecoder(fuse_round=True)`). Both decode the same prompts (greedy, 256 tokens, EOS
ignored), alternating, `--repeats` times each; round cost = (end-to-end - prefill) / rounds,
compared with the verify + draft steps graph-timed in isolation (issue 7's goal: <= 1.2x). Plain
AR (q = 1) runs in both modes too, so the speedups divide by a baseline of the same mode. Checks
that both modes give the same tokens. Writes DIR/round_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import gpu_speedup  # noqa: E402
from gpu_projection import step_times  # noqa: E402
from gpu_speedup import FIX, build_prompts, run_ours  # noqa: E402

from dflash_plugin.checkpoint import load_drafter  # noqa: E402
from dflash_plugin.cli import load_target  # noqa: E402
from dflash_plugin.fast import build_decoder  # noqa: E402
from dflash_plugin.fast.loop import compile_steps  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--target", default=str(FIX / "code-target"))
    p.add_argument("--drafter", default=str(FIX / "code-target-dflash-b16"))
    p.add_argument("--prompts", default=str(FIX / "dev-prompts.jsonl"))
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="compiled pointwise + accept steps")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    gpu_speedup.DEVICE = a.device  # its run_ours syncs CUDA only there
    if a.compile:
        compile_steps()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model, tok = load_target(a.target, a.device, dtype)
    drafter = load_drafter(a.drafter, a.device, dtype)
    prompts = build_prompts(tok, a.prompts, a.limit)
    n = a.max_new_tokens
    max_len = max(len(x) for x in prompts) + n + 16
    decs = {(kind, mode): build_decoder(model, drafter if kind == "dflash" else None, batch=1,
                                        max_len=max_len, max_block=16,
                                        fuse_round=mode == "fused")
            for kind in ("plain", "dflash") for mode in ("split", "fused")}
    cases = [("plain", 1, "ar")] + [("dflash", b, "dflash") for b in a.block_sizes]
    for kind, block, prop in cases:  # warm-up + graph capture
        for mode in ("split", "fused"):
            run_ours(decs[kind, mode], prompts[:1], 1, block, prop, 8)
    runs: dict[str, list[dict]] = {}
    for _ in range(a.repeats):
        for kind, block, prop in cases:
            for mode in ("split", "fused"):
                r = run_ours(decs[kind, mode], prompts, 1, block, prop, n)
                runs.setdefault(f"{mode} B{block}", []).append(r)
                print(f"{mode} B{block}: {r['tokens_per_second']:.1f} tok/s, round "
                      f"{r['round_ms']:.4f} ms, tau {r['tau']:.3f}", flush=True)
    out = {"date": str(date.today()), "device": a.device,
           "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
           "args": vars(a), "modes": {}}
    for block in a.block_sizes:
        st = step_times(decs["dflash", "split"], [block])
        iso = st["verify"][block] + st["draft"][block]
        for mode in ("split", "fused"):
            rs, ar = runs[f"{mode} B{block}"], runs[f"{mode} B1"]
            same = all(r["tokens"] == runs[f"split B{block}"][0]["tokens"] for r in rs)
            round_ms = statistics.median(r["round_ms"] for r in rs)
            tps = statistics.median(r["tokens_per_second"] for r in rs)
            ar_tps = statistics.median(r["tokens_per_second"] for r in ar)
            out["modes"][f"{mode} B{block}"] = {
                "round_ms": round_ms, "verify_ms": st["verify"][block],
                "draft_ms": st["draft"][block], "round_over_isolated": round_ms / iso,
                "tokens_per_second": tps, "ar_tokens_per_second": ar_tps,
                "speedup_vs_ar_same_mode": tps / ar_tps, "tau": rs[0]["tau"],
                "round_ms_runs": [r["round_ms"] for r in rs], "tokens_equal_split": same}
            print(mode, block, json.dumps(out["modes"][f"{mode} B{block}"]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "round_overhead.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
