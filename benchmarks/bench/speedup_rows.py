"""The row groups of `gpu_speedup.py` in our fast runtime (module docstring there: what each
group measures): `cold_rows`, `warm_rows`, `identity_rows`, `adaptive_rows` (one batch size),
`batch_rows` (one batch size: AR, n-gram and DFlash per block), `overhead_rows` and
`projection_rows` (the Qwen3-8B-shape projection). The rows against HF `generate` and the z-lab
loop are in `bench.reference_rows`; the tree rows in `bench.tree_rows`.

They share one `Speedup`: the results dict R, the command-line args, the loaded target and
drafter, the prompts, the token outputs the agreement checks compare, and the decoders built so
far (`decoder`: one per kind, batch and invariance; `ready`: that decoder warmed up over every
shape of a pass).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .common import agreement, attempt, checkout_first, read_prompts
from .fast_rows import adaptive_batch, run_cold, run_ours, warm_up
from .projection import accept_times, project_8b, step_times

checkout_first()

from dflash_plugin.fast import build_decoder  # noqa: E402


def build_prompts(tok, path, limit):
    return [tok(p).input_ids for p in read_prompts(path)][:limit]


@dataclass
class Speedup:
    """What the row groups of one run share (module docstring)."""

    R: dict
    args: object
    device: str
    model: object
    drafter: object
    tok: object
    prompts: list
    slow: list  # the prompts of the HF / z-lab rows (batch 1)
    N: int  # --max-new-tokens
    width: int  # the longest prompt
    max_len: int
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    warmed: dict = field(default_factory=dict)
    decs: dict = field(default_factory=dict)

    def add_row(self, name, batch, block, r, n_prompts):
        row = {"row": name, "batch": batch, "block": block, "prompts": n_prompts,
               **{k: v for k, v in r.items() if k not in ("tokens",)}}
        self.R["rows"].append(row)
        print(f"  {name} b={batch} B={block}: {r['tokens_per_second']:.1f} tok/s tau "
              f"{r.get('tau', 1):.3f}", flush=True)

    def decoder(self, kind, batch, invariant=None):
        invariant = self.args.invariant if invariant is None else invariant
        key = (kind, batch, invariant)
        if key not in self.decs:
            a = self.args
            self.decs[key] = build_decoder(self.model, self.drafter if kind == "dflash" else None,
                                           batch=batch, max_len=self.max_len, max_block=16,
                                           attention=a.attention, prefill_bucket=a.prefill_bucket,
                                           invariant=invariant)
        return self.decs[key]

    def ready(self, kind, batch, ps, invariant=None):
        """The decoder, warmed up over every shape of a pass over `ps` in chunks of `batch`."""
        invariant = self.args.invariant if invariant is None else invariant
        dec = self.decoder(kind, batch, invariant)
        s = warm_up(dec, ps, batch, self.warmed)
        self.R["warmup_seconds"][f"{kind} b{batch}{' invariant' if invariant else ''}"] = s
        return dec


def cold_rows(S: Speedup):
    """First-request latency, fresh processes, bucketing off (before) and on (after)."""
    args, R = S.args, S.R
    R["cold"] = []
    for prop, block in (("ar", 1), ("dflash", 16)):
        for bucket in (0, args.prefill_bucket or 64):
            cfg = {"device": S.device, "compile": args.compile, "target": args.target,
                   "drafter": args.drafter, "prompts": args.prompts, "limit": args.limit,
                   "proposer": prop, "block": block, "max_new": S.N, "max_len": S.max_len,
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


def warm_rows(S: Speedup):
    """Batch 1, AR vs DFlash after a full untimed pass over the same prompts."""
    prompts = S.prompts
    for kind, block, prop in [("plain", 1, "ar")] + [("dflash", b, "dflash")
                                                    for b in S.args.block_sizes]:
        dec = S.ready(kind, 1, prompts)
        run_ours(dec, prompts, 1, block, prop, S.N)  # the full pass: every shape seen
        r = run_ours(dec, prompts, 1, block, prop, S.N)
        S.add_row(f"ours {'AR' if prop == 'ar' else 'DFlash'} (warm)", 1, block, r, len(prompts))


def identity_rows(S: Speedup):
    """bf16 identity with plain decoding, batch-invariant runtime off and on (on: CUDA or
    TRITON_INTERPRET=1)."""
    prompts, N, sizes = S.prompts, S.N, S.args.block_sizes
    res = S.R["checks"]["bf16_identity"] = {}
    for inv in (False, True):
        name = f"invariant {'on' if inv else 'off'}"
        if inv and S.device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            res[name] = {"skipped": "needs CUDA"}
            continue
        dec = S.ready("dflash", 1, prompts, inv)
        runs = {"ar": run_ours(dec, prompts, 1, 1, "ar", N)}
        for b in sizes:
            runs[f"dflash B{b}"] = run_ours(dec, prompts, 1, b, "dflash", N)
        runs[f"ngram B{max(sizes)}"] = run_ours(dec, prompts, 1, max(sizes), "ngram", N)
        res[name] = {f"{k} vs ar": agreement(r["tokens"], runs["ar"]["tokens"])
                     for k, r in runs.items() if k != "ar"}
        res[name]["tokens_per_second"] = {k: round(r["tokens_per_second"], 1)
                                          for k, r in runs.items()}
        print(f"  identity {name}: {res[name]}", flush=True)


def adaptive_rows(S: Speedup, batch):
    """Adaptive speculation vs plain and fixed DFlash, batch x --adaptive-k prompts (cycled)."""
    args, N = S.args, S.N
    every = build_prompts(S.tok, args.prompts, None)
    n = batch * args.adaptive_k
    ps = (every * -(-n // len(every)))[:n]
    a_len = max(len(x) for x in every) + N + 16
    mk = {"batch": batch, "max_len": a_len, "max_block": 16, "attention": args.attention,
          "prefill_bucket": args.prefill_bucket, "invariant": args.invariant}
    plain, dfl = build_decoder(S.model, None, **mk), build_decoder(S.model, S.drafter, **mk)
    out = adaptive_batch(plain, dfl, ps, batch, N, {},  # new decoders: warm each
                         reads_every=args.adaptive_reads_every)
    for key, name, block in (("plain", "AR", 1), ("fixed", "DFlash fixed", 16),
                             ("adaptive", "adaptive", 16)):
        S.add_row(f"ours {name} (adaptive set)", batch, block, out["runs"][key], len(ps))
    out["summary"]["unique_prompts"] = min(n, len(every))
    S.R.setdefault("adaptive", []).append(out["summary"])
    print("  adaptive:", json.dumps(out["summary"]), flush=True)


def batch_rows(S: Speedup, batch):
    """Our runtime at one batch size: AR, then n-gram and DFlash per block size, each part in
    its own `attempt`."""
    prompts, N, outputs = S.prompts, S.N, S.outputs

    def ar():
        r = run_ours(S.ready("plain", batch, prompts), prompts, batch, 1, "ar", N)
        outputs[f"ar-b{batch}"] = r["tokens"]
        S.add_row("ours AR", batch, 1, r, len(prompts))
    attempt(S.R, f"ours AR b{batch}", ar)
    for block in S.args.block_sizes:
        def ng(block=block):
            r = run_ours(S.ready("plain", batch, prompts), prompts, batch, block, "ngram", N)
            outputs[f"ngram-B{block}-b{batch}"] = r["tokens"]
            S.add_row("ours n-gram (host lookup)", batch, block, r, len(prompts))
        attempt(S.R, f"ours n-gram B{block} b{batch}", ng)

        def df(block=block):
            dec = S.ready("dflash", batch, prompts)
            r = run_ours(dec, prompts, batch, block, "dflash", N)
            prof = run_ours(dec, prompts, batch, block, "dflash", N, profile=True)
            r["split_seconds"] = prof["split_seconds"]
            r["profiled_seconds"] = prof["seconds"]
            outputs[f"dflash-B{block}-b{batch}"] = r["tokens"]
            S.add_row("ours DFlash", batch, block, r, len(prompts))
        attempt(S.R, f"ours DFlash B{block} b{batch}", df)


def overhead_rows(S: Speedup):
    """Per-round overhead at batch 1 vs isolated graph timings of the same steps."""
    R = S.R
    o = R["checks"]["round_overhead"] = {}
    t1 = step_times(S.decoder("plain", 1), [1])["verify"][1]
    o["T1_ms"] = t1
    ar_row = next(r for r in R["rows"] if r["row"] == "ours AR" and r["batch"] == 1)
    for block in S.args.block_sizes:
        st = step_times(S.decoder("dflash", 1), [block])
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
                          **accept_times(S.decoder("dflash", 1), block)}
        print(f"  B{block}: {o[f'B{block}']}")


def projection_rows(S: Speedup):
    """The Qwen3-8B-shape projection (random weights) at the batch-1 DFlash rows' tau."""
    R = S.R
    S.decs.clear()
    taus = {f"dflash B{r['block']}": r["tau"] for r in R["rows"]
            if r["row"] == "ours DFlash" and r["batch"] == 1}
    R["projection_8b"] = project_8b(taus or {"dflash B16": 3.0}, attention=S.args.attention)
    print("  8B:", json.dumps(R["projection_8b"]["projection"]),
          R["projection_8b"]["verify_ms"], R["projection_8b"]["draft_ms"])
