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
import json
import os
import sys
import time
from pathlib import Path

import torch
from bench.common import (
    FIXTURES,
    agreement,
    attempt,
    checkout_first,
    read_prompts,
    run_info,
    write_json,
)

checkout_first()

from bench.fast_rows import (  # noqa: E402
    adaptive_batch,
    adaptive_markdown,
    run_cold,
    run_ours,
    warm_up,
)
from bench.plot import markdown, plot  # noqa: E402
from bench.projection import accept_times, project_8b, step_times  # noqa: E402
from bench.tree_rows import sampled_tree_rows, tree_rows  # noqa: E402

from dflash_plugin.checkpoint import load_drafter  # noqa: E402
from dflash_plugin.fast import build_decoder, fast_generate  # noqa: E402
from dflash_plugin.fast.loop import compile_steps  # noqa: E402
from dflash_plugin.generate import speculative_generate  # noqa: E402
from dflash_plugin.loading import load_target  # noqa: E402
from dflash_plugin.proposers import DFlashProposer  # noqa: E402

FIX = FIXTURES
GROUPS = ("batches", "slow", "warm", "cold", "identity", "fp32", "overhead", "8b", "tree",
          "adaptive")
DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def zlab_module():
    """z-lab's `dflash.model` (PyPI dflash 0.1.0, installed --no-deps or in DFLASH_ORACLE_DIR)."""
    oracle = os.environ.get("DFLASH_ORACLE_DIR")
    if oracle and oracle not in sys.path:
        sys.path.insert(0, oracle)
    import dflash.model as zl

    if DEVICE != "cuda":
        zl._cuda_time = time.perf_counter  # their timer syncs CUDA
    return zl


def zlab_drafter(zl, ours):
    """Their drafter class with our weights (same checkpoint format)."""
    from transformers import Qwen3Config

    theirs = zl.DFlashDraftModel(Qwen3Config.from_dict(ours.config.to_dict()))
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs.to(ours.fc.weight.device, ours.fc.weight.dtype).eval()


def build_prompts(tok, path, limit):
    return [tok(p).input_ids for p in read_prompts(path)][:limit]


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
                   "(fast.loop.compile_steps)")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "triton"],
                   help="attention backend of our runtime's steps (fast/attention.py)")
    p.add_argument("--prefill-bucket", type=int, default=64,
                   help="pad prompts to a multiple of this (0 = off, the old runtime)")
    p.add_argument("--invariant", action="store_true",
                   help="timed rows use the batch-invariant runtime (identity rows run both)")
    p.add_argument("--adaptive-k", type=int, default=8,
                   help="`adaptive` rows: batch x k dev prompts per batch size (--prompts file)")
    p.add_argument("--adaptive-reads-every", type=int, default=8,
                   help="`adaptive` rows: most rounds at q > 1 between host reads (policy updates)")
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
    global DEVICE
    DEVICE = args.device
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    if args.quick:
        args.limit, args.slow_limit, args.batches, args.max_new_tokens = 8, 2, [1, 4], 128
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    R = {"run": run_info(DEVICE), "dtype": str(dtype), "args": vars(args),
         "rows": [], "checks": {}, "errors": {}, "warmup_seconds": {},
         "partial_path": str(out_dir / "results.partial.json")}
    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    model, tok = load_target(args.target, DEVICE, dtype)
    drafter = load_drafter(args.drafter, DEVICE, dtype)
    prompts = build_prompts(tok, args.prompts, args.limit)
    slow = prompts[: args.slow_limit]
    N = args.max_new_tokens
    width = max(len(x) for x in prompts)
    max_len = width + N + 16
    outputs: dict[str, list[list[int]]] = {}
    warmed: dict = {}

    def add_row(name, batch, block, r, n_prompts):
        row = {"row": name, "batch": batch, "block": block, "prompts": n_prompts,
               **{k: v for k, v in r.items() if k not in ("tokens",)}}
        R["rows"].append(row)
        print(f"  {name} b={batch} B={block}: {r['tokens_per_second']:.1f} tok/s tau "
              f"{r.get('tau', 1):.3f}", flush=True)

    decs = {}

    def decoder(kind, batch, invariant=args.invariant):
        key = (kind, batch, invariant)
        if key not in decs:
            decs[key] = build_decoder(model, drafter if kind == "dflash" else None, batch=batch,
                                      max_len=max_len, max_block=16, attention=args.attention,
                                      prefill_bucket=args.prefill_bucket, invariant=invariant)
        return decs[key]

    def ready(kind, batch, ps, invariant=args.invariant):
        """The decoder, warmed up over every shape of a pass over `ps` in chunks of `batch`."""
        dec = decoder(kind, batch, invariant)
        s = warm_up(dec, ps, batch, warmed)
        R["warmup_seconds"][f"{kind} b{batch}{' invariant' if invariant else ''}"] = s
        return dec

    # --- cold: first-request latency, fresh processes, bucketing off (before) and on (after) ---
    def cold():
        R["cold"] = []
        for prop, block in (("ar", 1), ("dflash", 16)):
            for bucket in (0, args.prefill_bucket or 64):
                cfg = {"device": DEVICE, "compile": args.compile, "target": args.target,
                       "drafter": args.drafter, "prompts": args.prompts, "limit": args.limit,
                       "proposer": prop, "block": block, "max_new": N, "max_len": max_len,
                       "attention": args.attention, "bucket": bucket,
                       "invariant": args.invariant, "new_prompts": args.cold_prompts}
                name = "AR" if prop == "ar" else f"DFlash B{block}"
                try:
                    c = {"name": name, "proposer": prop, "bucket": bucket,
                         **run_cold(cfg, args.cold_timeout)}
                except Exception as err:  # noqa: BLE001 - keep the other cold rows
                    c = {"name": name, "proposer": prop, "bucket": bucket, "error": repr(err)}
                R["cold"].append(c)
                print(f"  cold {name} bucket={bucket}: " + json.dumps(
                    {k: (round(v, 3) if isinstance(v, float) else v) for k, v in c.items()}),
                    flush=True)
    if "cold" in groups:
        attempt(R, "cold first-request latency", cold)

    # --- warm: batch 1, AR vs DFlash after a full untimed pass over the same prompts ---
    def warm():
        for kind, block, prop in [("plain", 1, "ar")] + [("dflash", b, "dflash")
                                                        for b in args.block_sizes]:
            dec = ready(kind, 1, prompts)
            run_ours(dec, prompts, 1, block, prop, N)  # the full pass: every shape seen
            r = run_ours(dec, prompts, 1, block, prop, N)
            add_row(f"ours {'AR' if prop == 'ar' else 'DFlash'} (warm)", 1, block, r,
                    len(prompts))
    if "warm" in groups:
        attempt(R, "warm batch 1", warm)

    # --- bf16 identity with plain decoding, batch-invariant runtime off and on ---
    def identity():
        res = R["checks"]["bf16_identity"] = {}
        for inv in (False, True):
            name = f"invariant {'on' if inv else 'off'}"
            if inv and DEVICE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                res[name] = {"skipped": "needs CUDA"}
                continue
            dec = ready("dflash", 1, prompts, inv)
            runs = {"ar": run_ours(dec, prompts, 1, 1, "ar", N)}
            for b in args.block_sizes:
                runs[f"dflash B{b}"] = run_ours(dec, prompts, 1, b, "dflash", N)
            runs[f"ngram B{max(args.block_sizes)}"] = run_ours(
                dec, prompts, 1, max(args.block_sizes), "ngram", N)
            res[name] = {f"{k} vs ar": agreement(r["tokens"], runs["ar"]["tokens"])
                         for k, r in runs.items() if k != "ar"}
            res[name]["tokens_per_second"] = {k: round(r["tokens_per_second"], 1)
                                              for k, r in runs.items()}
            print(f"  identity {name}: {res[name]}", flush=True)
    if "identity" in groups:
        attempt(R, "bf16 identity", identity)

    # --- adaptive speculation vs plain and fixed DFlash, same prompts per batch size ---
    def adaptive(batch):
        every = build_prompts(tok, args.prompts, None)
        n = batch * args.adaptive_k
        ps = (every * -(-n // len(every)))[:n]
        a_len = max(len(x) for x in every) + N + 16
        mk = {"batch": batch, "max_len": a_len, "max_block": 16, "attention": args.attention,
              "prefill_bucket": args.prefill_bucket, "invariant": args.invariant}
        plain, dfl = build_decoder(model, None, **mk), build_decoder(model, drafter, **mk)
        out = adaptive_batch(plain, dfl, ps, batch, N, {},  # new decoders: warm each
                             reads_every=args.adaptive_reads_every)
        for key, name, block in (("plain", "AR", 1), ("fixed", "DFlash fixed", 16),
                                 ("adaptive", "adaptive", 16)):
            add_row(f"ours {name} (adaptive set)", batch, block, out["runs"][key], len(ps))
        out["summary"]["unique_prompts"] = min(n, len(every))
        R.setdefault("adaptive", []).append(out["summary"])
        print("  adaptive:", json.dumps(out["summary"]), flush=True)
    for batch in args.batches if "adaptive" in groups else []:
        attempt(R, f"adaptive b{batch}", lambda batch=batch: adaptive(batch))

    # --- our runtime: AR, n-gram, DFlash at every batch size ---
    for batch in args.batches if "batches" in groups else []:
        def ar(batch=batch):
            r = run_ours(ready("plain", batch, prompts), prompts, batch, 1, "ar", N)
            outputs[f"ar-b{batch}"] = r["tokens"]
            add_row("ours AR", batch, 1, r, len(prompts))
        attempt(R, f"ours AR b{batch}", ar)
        for block in args.block_sizes:
            def ng(batch=batch, block=block):
                r = run_ours(ready("plain", batch, prompts), prompts, batch, block, "ngram", N)
                outputs[f"ngram-B{block}-b{batch}"] = r["tokens"]
                add_row("ours n-gram (host lookup)", batch, block, r, len(prompts))
            attempt(R, f"ours n-gram B{block} b{batch}", ng)

            def df(batch=batch, block=block):
                dec = ready("dflash", batch, prompts)
                r = run_ours(dec, prompts, batch, block, "dflash", N)
                prof = run_ours(dec, prompts, batch, block, "dflash", N, profile=True)
                r["split_seconds"] = prof["split_seconds"]
                r["profiled_seconds"] = prof["seconds"]
                outputs[f"dflash-B{block}-b{batch}"] = r["tokens"]
                add_row("ours DFlash", batch, block, r, len(prompts))
            attempt(R, f"ours DFlash B{block} b{batch}", df)

    # --- HF generate and the z-lab loop at batch 1 (ours re-timed on the same prompts) ---
    def hf():
        secs, toks = [], []
        for ids in slow[:1] + slow:  # the first run warms up
            x = torch.tensor([ids], device=DEVICE)
            sync()
            t0 = time.perf_counter()
            y = model.generate(x, do_sample=False, max_new_tokens=N, min_new_tokens=N,
                               pad_token_id=model.config.pad_token_id or 0)
            sync()
            secs.append(time.perf_counter() - t0)
            toks.append(y[0, len(ids):].tolist())
        secs, toks = secs[1:], toks[1:]
        outputs["hf"] = toks
        add_row("HF generate", 1, 1, {"seconds": sum(secs), "new_tokens": N * len(slow),
                                      "tokens_per_second": N * len(slow) / sum(secs),
                                      "tau": 1.0}, len(slow))
    if "slow" in groups:
        attempt(R, "HF generate b1", hf)

    def zlab_rows():
        zl = zlab_module()
        theirs = zlab_drafter(zl, drafter)
        for block in args.block_sizes:
            secs, toks, lens = [], [], []
            for ids in slow[:1] + slow:
                x = torch.tensor([ids], device=DEVICE)
                sync()
                t0 = time.perf_counter()
                st = zl.dflash_generate(theirs, model, x, N, None, block_size=block,
                                        return_stats=True)
                sync()
                secs.append(time.perf_counter() - t0)
                toks.append(st.output_ids[0, len(ids):].tolist())
                lens.append(list(st.acceptance_lengths))
            secs, toks, lens = secs[1:], toks[1:], lens[1:]
            outputs[f"zlab-B{block}"] = toks
            rounds = sum(len(x) for x in lens)
            add_row("z-lab dflash 0.1.0", 1, block, {
                "seconds": sum(secs), "new_tokens": sum(map(len, toks)),
                "tokens_per_second": sum(map(len, toks)) / sum(secs),
                "tau": sum(map(sum, lens)) / rounds, "round_ms": sum(secs) / rounds * 1e3,
                "tau_per_prompt": [round(sum(x) / len(x), 3) for x in lens]}, len(slow))
    if "slow" in groups:
        attempt(R, "z-lab dflash b1", zlab_rows)

    def ours_on_slow():
        for kind, block, prop in [("plain", 1, "ar")] + [("dflash", b, "dflash")
                                                        for b in args.block_sizes]:
            r = run_ours(ready(kind, 1, slow), slow, 1, block, prop, N)
            outputs[f"slow-{prop}-B{block}"] = r["tokens"]
            add_row(f"ours {'AR' if prop == 'ar' else 'DFlash'} (slow-row prompts)", 1, block,
                    r, len(slow))
    if "slow" in groups:
        attempt(R, "ours on the HF/z-lab prompts", ours_on_slow)

    # --- agreement (bf16) ---
    def agree():
        a = R["checks"]["bf16_agreement"] = {}
        for key, ref in (("hf", "slow-ar-B1"), ("slow-dflash-B16", "slow-ar-B1"),
                         ("zlab-B16", "slow-dflash-B16"), ("zlab-B8", "slow-dflash-B8"),
                         ("zlab-B16", "hf")):
            if key in outputs and ref in outputs:
                a[f"{key} vs {ref}"] = agreement(outputs[key], outputs[ref])
        for k in outputs:
            if k.startswith(("dflash-", "ngram-")):
                b = k.rsplit("-b", 1)[1]
                if f"ar-b{b}" in outputs:
                    a[f"{k} vs ar-b{b}"] = agreement(outputs[k], outputs[f"ar-b{b}"])
    attempt(R, "bf16 agreement", agree)

    # --- fp32 token identity: fast (graphs) vs reference loop vs HF, on 4 prompts ---
    def fp32():
        m32, _ = load_target(args.target, DEVICE, torch.float32)
        d32 = load_drafter(args.drafter, DEVICE, torch.float32)
        ps, n = prompts[:4], 64
        ref = speculative_generate(m32, DFlashProposer(d32), ps, block_size=16,
                                   max_new_tokens=n, fast=False)
        dec = build_decoder(m32, d32, batch=4, max_len=width + n + 16, attention=args.attention)
        fast = fast_generate(dec, ps, block_size=16, max_new_tokens=n)
        hf_out = [m32.generate(torch.tensor([x], device=DEVICE), do_sample=False,
                               max_new_tokens=n, min_new_tokens=n, pad_token_id=0)[0, len(x):]
                  .tolist() for x in ps]
        c = R["checks"]["fp32_identity"] = {
            "prompts": len(ps), "new_tokens": n,
            "fast_vs_reference": fast.tokens == ref.tokens, "fast_vs_hf": fast.tokens == hf_out,
            "round_tokens_equal": [r.round_tokens for r in fast.metrics.requests]
            == [r.round_tokens for r in ref.metrics.requests]}
        try:  # the z-lab loop, batch 1, same fp32 weights
            zl = zlab_module()
            theirs = zlab_drafter(zl, d32)
            st = [zl.dflash_generate(theirs, m32, torch.tensor([x], device=DEVICE), n, None,
                                     block_size=16, return_stats=True) for x in ps]
            c["fast_vs_zlab"] = fast.tokens == [s.output_ids[0, len(x):].tolist()
                                                for s, x in zip(st, ps)]
            c["round_tokens_equal_zlab"] = [r.round_tokens for r in fast.metrics.requests] == [
                list(s.acceptance_lengths) for s in st]
        except Exception as err:  # noqa: BLE001
            c["zlab_error"] = repr(err)
        print("  fp32:", c)
    if "fp32" in groups:
        attempt(R, "fp32 identity", fp32)

    # --- per-round overhead at batch 1 vs isolated graph timings of the same steps ---
    def overhead():
        o = R["checks"]["round_overhead"] = {}
        t1 = step_times(decoder("plain", 1), [1])["verify"][1]
        o["T1_ms"] = t1
        ar_row = next(r for r in R["rows"] if r["row"] == "ours AR" and r["batch"] == 1)
        for block in args.block_sizes:
            st = step_times(decoder("dflash", 1), [block])
            row = next(r for r in R["rows"] if r["row"] == "ours DFlash" and r["batch"] == 1
                       and r["block"] == block)
            iso = st["verify"][block] + st["draft"][block]
            proj = row["tau"] * t1 / iso
            sp = row["tokens_per_second"] / ar_row["tokens_per_second"]
            o[f"B{block}"] = {"verify_ms": st["verify"][block], "draft_ms": st["draft"][block],
                              "round_ms": row["round_ms"], "round_over_isolated":
                              row["round_ms"] / iso, "tau": row["tau"],
                              "projected_speedup": proj, "measured_speedup": sp,
                              "measured_over_projected": sp / proj,
                              **accept_times(decoder("dflash", 1), block)}
            print(f"  B{block}: {o[f'B{block}']}")
    if "overhead" in groups and "batches" in groups:
        attempt(R, "round overhead", overhead)

    # --- tree rounds vs linear DFlash vs AR (benchmarks/bench/tree_rows.py) ---
    if "tree" in groups:
        attempt(R, "tree rounds", lambda: tree_rows(R, model, drafter, prompts, N, max_len, args,
                                                     add_row))
        if args.tree_temperature > 0:
            attempt(R, "sampled tree rounds", lambda: sampled_tree_rows(
                R, model, drafter, prompts, N, max_len, args, add_row))

    # --- Qwen3-8B-shape projection (random weights) ---
    def proj():
        decs.clear()
        taus = {f"dflash B{r['block']}": r["tau"] for r in R["rows"]
                if r["row"] == "ours DFlash" and r["batch"] == 1}
        R["projection_8b"] = project_8b(taus or {"dflash B16": 3.0}, attention=args.attention)
        print("  8B:", json.dumps(R["projection_8b"]["projection"]),
              R["projection_8b"]["verify_ms"], R["projection_8b"]["draft_ms"])
    if not args.skip_8b and DEVICE == "cuda" and "8b" in groups:
        attempt(R, "8B projection", proj)

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
