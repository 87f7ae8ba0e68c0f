"""How the side-by-side scripts time our fast runtime: `warm_up` (a decoder's warm-up over every
shape a pass hits), `run_ours` (a timed pass over prompts in chunks of a batch), *adaptive rows*
(`adaptive_batch`: plain vs fixed DFlash vs adaptive speculation at one batch size; the table
`adaptive_markdown`) and *cold rows*:
the first-request latency of a batch-1 decoder in a fresh process with empty Triton and inductor
caches (`run_cold` starts this module as that process; `cold_worker` is what it runs):

    PYTHONPATH=benchmarks python -m bench.fast_rows '{"device": "cuda", "proposer": "ar", ...}'

A cold row reports: load_s (weights), startup_s (`FastDecoder.warmup()`, bucketing on; 0 off),
first_request_s (the process's first request), new_length_s (requests of prompt lengths not
seen before in this process) and repeat_s (the same requests again: steady state).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter

import torch

from .common import agreement, checkout_first, read_prompts

checkout_first()

from dflash_plugin.adaptive import AdaptiveConfig  # noqa: E402
from dflash_plugin.checkpoint import load_drafter  # noqa: E402
from dflash_plugin.fast import build_decoder, fast_generate  # noqa: E402
from dflash_plugin.fast.accept import compile_steps  # noqa: E402
from dflash_plugin.fast.adaptive_loop import measure_round_ms  # noqa: E402
from dflash_plugin.loading import load_target  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm_up(dec, prompts, batch, done: dict) -> float:
    """`dec.warmup()` over every shape a pass over `prompts` in chunks of `batch` hits: all padded
    widths (bucketing on) or exactly the chunks' widths (off); every block length. Once per
    decoder and width set; returns the seconds it took."""
    widths = None if dec.prefill_bucket else tuple(sorted(
        {max(len(p) for p in prompts[i:i + batch]) for i in range(0, len(prompts), batch)}))
    key = (id(dec), widths)
    if key not in done:
        done[key] = dec.warmup(widths)
    return done[key]


def run_ours(dec, prompts, batch, block, proposer, max_new, profile=False,
             adaptive=None) -> dict:
    """All prompts in chunks of `batch`; end-to-end seconds include prefill. With `adaptive`
    (an `AdaptiveConfig`), "block_lengths" sums the rounds per chosen block length."""
    toks, reqs, secs, pre = [], [], [], 0.0
    draft_s = verify_s = 0.0
    used = Counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        sync()
        t0 = time.perf_counter()
        res = fast_generate(dec, chunk, block_size=block, max_new_tokens=max_new,
                            proposer=proposer, profile=profile, adaptive=adaptive)
        sync()
        secs.append(time.perf_counter() - t0)
        used.update(res.metrics.block_lengths or {})
        pre += res.metrics.prefill_seconds
        draft_s += res.metrics.draft_seconds
        verify_s += res.metrics.verify_seconds
        toks += res.tokens
        reqs += res.metrics.requests
    total, new = sum(secs), sum(r.new_tokens for r in reqs)
    rounds = sum(r.rounds for r in reqs) if batch == 1 else None
    out = {"tokens": toks, "seconds": total, "chunk_seconds": secs, "prefill_seconds": pre,
           "new_tokens": new, "tokens_per_second": new / total,
           "tau": sum(sum(r.round_tokens) for r in reqs) / max(sum(r.rounds for r in reqs), 1),
           "tau_per_prompt": [round(r.tau, 3) for r in reqs],
           "rounds_per_request": [r.rounds for r in reqs]}
    if rounds:
        out["round_ms"] = (total - pre) / rounds * 1e3
    if adaptive is not None:
        out["block_lengths"] = dict(sorted(used.items()))
    if profile:
        out["split_seconds"] = {"draft": draft_s, "verify": verify_s, "prefill": pre,
                                "overhead": total - pre - draft_s - verify_s}
    return out


def adaptive_batch(plain, dflash, prompts, batch, max_new, warmed, block=16,
                   cfg: AdaptiveConfig | None = None, reads_every: int = 16) -> dict:
    """Plain decoding (`plain`: a decoder without drafter), fixed DFlash (q = `block`) and
    adaptive speculation (`dflash` decoder, `cfg`; default `AdaptiveConfig(reads_every=...)`)
    over the same prompts in chunks of `batch`, each decoder warmed up over its shapes and
    `dflash`'s round times measured first (`measure_round_ms`: powers of two up to `block`).
    Returns the three runs and a summary: tokens/s, adaptive over max(plain, fixed), the
    chosen-q histogram, the round times and the token identity of fixed / adaptive vs plain."""
    warm = {"plain": warm_up(plain, prompts, batch, warmed),
            "dflash": warm_up(dflash, prompts, batch, warmed)}
    t0 = time.perf_counter()
    cands = [q for q in (1, 2, 4, 8, 16, 32) if q <= block]
    round_ms = measure_round_ms(dflash, cands)
    plain_ms = measure_round_ms(plain, [1])[1]
    measure_s = time.perf_counter() - t0
    cfg = cfg or AdaptiveConfig(reads_every=reads_every)
    runs = {"plain": run_ours(plain, prompts, batch, 1, "ar", max_new),
            "fixed": run_ours(dflash, prompts, batch, block, "dflash", max_new),
            "adaptive": run_ours(dflash, prompts, batch, block, "dflash", max_new,
                                 adaptive=cfg)}
    tps = {k: r["tokens_per_second"] for k, r in runs.items()}
    best = max(tps["plain"], tps["fixed"])
    summary = {
        "batch": batch, "prompts": len(prompts), "block": block, "max_new_tokens": max_new,
        "tokens_per_second": {k: round(v, 1) for k, v in tps.items()},
        "adaptive_over_best": round(tps["adaptive"] / best, 4),
        "adaptive_over_plain": round(tps["adaptive"] / tps["plain"], 4),
        "fixed_over_plain": round(tps["fixed"] / tps["plain"], 4),
        "tau": {k: round(r["tau"], 3) for k, r in runs.items()},
        "block_lengths": runs["adaptive"]["block_lengths"],
        "round_ms": {q: round(t, 4) for q, t in round_ms.items()},
        "plain_decoder_round_ms": round(plain_ms, 4),
        "identity_vs_plain": {k: agreement(runs[k]["tokens"], runs["plain"]["tokens"])
                              for k in ("fixed", "adaptive")},
        "warmup_seconds": warm, "measure_seconds": round(measure_s, 3),
        "policy": {k: v for k, v in vars(cfg).items() if k not in ("forced", "round_ms")}}
    return {"runs": runs, "summary": summary}


def adaptive_markdown(summaries: list[dict]) -> str:
    """The adaptive rows as a table: tokens/s of plain / fixed DFlash / adaptive per batch."""
    if not summaries:
        return ""
    lines = ["", "Adaptive speculation (our runtime, same prompts per batch size): tokens/s",
             "", "| batch | prompts | plain | DFlash fixed | adaptive | adaptive / max | "
             "chosen q (rounds) | identical vs plain (fixed, adaptive) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        t, i = s["tokens_per_second"], s["identity_vs_plain"]
        lines.append(f"| {s['batch']} | {s['prompts']} | {t['plain']} | {t['fixed']} | "
                     f"{t['adaptive']} | {s['adaptive_over_best']:.3f} | "
                     f"{' '.join(f'{q}:{n}' for q, n in s['block_lengths'].items())} | "
                     f"{i['fixed']['identical']}/{i['fixed']['of']}, "
                     f"{i['adaptive']['identical']}/{i['adaptive']['of']} |")
    return "\n".join(lines) + "\n"


def cold_worker(cfg: dict) -> dict:
    """One cold row in this (fresh) process: load, build a batch-1 decoder, `warmup()` when
    bucketing is on (the server's start-up), then time the process's first request, requests of
    prompt lengths never seen before, and the same requests again."""
    dev = cfg["device"]
    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    if cfg["compile"]:
        compile_steps()
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model, tok = load_target(cfg["target"], dev, dtype)
    drafter = load_drafter(cfg["drafter"], dev, dtype) if cfg["proposer"] == "dflash" else None
    by_len: dict[int, list[int]] = {}
    for text in read_prompts(cfg["prompts"])[:cfg["limit"]]:
        ids = tok(text).input_ids
        by_len.setdefault(len(ids), ids)
    picks = list(by_len.values())
    first, new = picks[0], picks[1:1 + cfg["new_prompts"]]
    dec = build_decoder(model, drafter, batch=1, max_len=cfg["max_len"], max_block=16,
                        attention=cfg["attention"], prefill_bucket=cfg["bucket"],
                        invariant=cfg["invariant"])
    load_s = time.perf_counter() - t0
    startup = dec.warmup() if cfg["bucket"] else 0.0

    def request(ids):
        sync()
        t = time.perf_counter()
        fast_generate(dec, [ids], block_size=cfg["block"], max_new_tokens=cfg["max_new"],
                      proposer=cfg["proposer"])
        sync()
        return time.perf_counter() - t
    first_s = request(first)
    new_s = [request(ids) for ids in new]
    again = [request(ids) for ids in new]
    return {"load_s": load_s, "startup_s": startup, "first_request_s": first_s,
            "first_len": len(first), "new_lengths": [len(x) for x in new],
            "new_length_s": new_s, "repeat_s": again,
            "new_length_median_s": statistics.median(new_s) if new_s else None,
            "repeat_median_s": statistics.median(again) if again else None}


def run_cold(cfg: dict, timeout: int) -> dict:
    """`cold_worker` in a child process with empty Triton and inductor caches."""
    tmp = tempfile.mkdtemp(prefix="cold-")
    bench_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # for `bench`
    path = os.pathsep.join(x for x in (bench_dir, os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "TRITON_CACHE_DIR": f"{tmp}/triton", "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "PYTHONPATH": path}
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "bench.fast_rows", json.dumps(cfg)], env=env,
                           capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [x for x in r.stdout.splitlines() if x.startswith("COLD_RESULT ")]
    if r.returncode or not lines:
        raise RuntimeError(f"cold worker rc={r.returncode}: {r.stderr[-1500:]}")
    return {**json.loads(lines[-1][len("COLD_RESULT "):]),
            "process_s": time.perf_counter() - t0}


if __name__ == "__main__":
    print("COLD_RESULT " + json.dumps(cold_worker(json.loads(sys.argv[1]))))
