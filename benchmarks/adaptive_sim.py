"""Trace-driven simulation of adaptive speculation: the policy's choices and tokens/s, on CPU.

With greedy decoding the output does not depend on the policy, and neither does what a round
accepts: a round whose anchor is generated token t drafts a full block (the adaptive loop always
does) from the same context whatever came before, so it accepts min(a(t), q - 1) drafts, where
a(t) is the drafter's agreement with the target after t. `traces` computes a(t) for every
prompt and t once (our fast runtime, fp32: one prefill of prompt + output, then one draft per t);
`simulate` replays the fast loop's host reads, `adaptive.BlockPolicy` decisions, caps and stops
over those traces with round times measured on the GPU (`gpu_speedup.py --rows adaptive` results:
`round_ms` per q and the plain decoder's step, per batch size). It predicts tokens/s of plain,
fixed-block and adaptive decoding; the GPU run stays the measurement, the simulation is a model
(fp32 traces, no launch gaps beyond `--read-ms` per host read). Use it to compare policies:
    python benchmarks/adaptive_sim.py traces --out out/sim/traces.json
    python benchmarks/adaptive_sim.py simulate --traces out/sim/traces.json \
        --results benchmarks/results/gpu-adaptive/results.json [--policy decay=0.8 ...]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from bench.common import DEV_PROMPTS, fixture, read_prompts, write_json

from dflash_plugin.adaptive import AdaptiveConfig, BlockPolicy
from dflash_plugin.fast.loop import AHEAD_CAP, rounds_ahead


@torch.inference_mode()
def traces(target, drafter, prompts: list[list[int]], max_new: int, block: int = 16,
           rows: int = 8) -> list[list[int]]:
    """a(t) for t = 0..max_new - 1 per prompt: drafts of a full block after generated token t
    that agree with the target's greedy continuation (capped by what remains); `rows` prompts
    at a time."""
    from dflash_plugin.fast import build_decoder
    from dflash_plugin.fast.drafter import draft_block
    from dflash_plugin.fast.loop import fast_generate

    width = max(map(len, prompts)) + max_new + 2 * block
    dec = build_decoder(target, drafter, batch=rows, max_len=width, max_block=block,
                        graphs=False, prefill_bucket=0)
    dc, out = dec.dcache, []
    for c in range(0, len(prompts), rows):
        chunk = prompts[c:c + rows]
        toks = fast_generate(dec, chunk, block_size=1, max_new_tokens=max_new,
                             proposer="ar").tokens
        full = [p + t for p, t in zip(chunk, toks)]
        dec.prefill(full + [full[0]] * (rows - len(full)), 1)  # every position's context
        base = torch.tensor([len(p) for p in chunk] + [len(chunk[0])] * (rows - len(chunk)))
        agree = torch.zeros(rows, max_new, dtype=torch.long)
        for t in range(max_new):
            at = base + t  # [rows] the anchors' positions
            dec.tcache.lengths.copy_(at)  # the drafter's cache shares these lengths
            dec.anchor.copy_(torch.tensor([f[n] for f, n in zip(
                full + [full[0]] * (rows - len(full)), at.tolist())]))
            keep = [[x[:, r, :, a:a + block].clone() for x in (dc.k, dc.v)]
                    for r, a in enumerate(at.tolist())]
            ids = draft_block(dec.drafter, dc, dec.drope, dec.target.embed, dec.target.lm_head,
                              dec.anchor, block)  # [rows, block - 1]
            for r, a in enumerate(at.tolist()):
                dc.k[:, r, :, a:a + block], dc.v[:, r, :, a:a + block] = keep[r]
            for r, f in enumerate(full):
                ref = torch.tensor(f[at[r] + 1:at[r] + block])
                same = (ids[r, :len(ref)] == ref).long().cumprod(0)
                agree[r, t] = int(same.sum())
        out += agree[:len(chunk)].tolist()
    return out


def _ms(round_ms: dict[int, float], q: int) -> float:
    """Measured time of a round of q, linear between measured q (q past the last: the last)."""
    if q in round_ms:
        return round_ms[q]
    lo = max((k for k in round_ms if k < q), default=min(round_ms))
    hi = min((k for k in round_ms if k > q), default=max(round_ms))
    if lo == hi:
        return round_ms[lo]
    return round_ms[lo] + (round_ms[hi] - round_ms[lo]) * (q - lo) / (hi - lo)


def simulate(rows: list[list[int]], round_ms: dict[int, float], batch: int, block: int,
             max_new: int, cfg: AdaptiveConfig | None = None, fixed: int | None = None,
             read_ms: float = 0.0, prefill_ms: float = 0.0) -> dict:
    """Tokens per second of `rows` (traces) in chunks of `batch`: adaptive with `cfg`, or a
    fixed block `fixed` (1 = plain); `prefill_ms` per chunk, `read_ms` per host read. Mirrors
    `fast.loop.fast_generate`'s loop (with full-block drafts near the end, as adaptive rounds
    draft; a fixed loop drafts only what remains there)."""
    total_ms, tokens, used = 0.0, 0, Counter()
    for c in range(0, len(rows), batch):
        total_ms += prefill_ms
        chunk = rows[c:c + batch]
        out_len, done = [1] * len(chunk), [max_new <= 1] * len(chunk)
        policy = BlockPolicy(cfg, round_ms, block, block - 1) if cfg is not None else None
        pending: list[tuple[int, list[int]]] = []
        while True:
            total_ms += read_ms
            for g, acc in pending:
                policy.observe_round(g, acc)
            pending = []
            live = [i for i in range(len(chunk)) if not done[i]]
            if not live:
                break
            rem = max(max_new - out_len[i] for i in live)
            cap = AHEAD_CAP
            if policy is not None:
                bsz, most = policy.choose()
                cap = min(cap, most)
            else:
                bsz = fixed
            g = min(bsz - 1, rem)
            ahead = rounds_ahead(rem, bsz)
            for _ in range(max(1, min(ahead, cap))):
                live = [i for i in range(len(chunk)) if not done[i]]
                accs = []
                for i in live:
                    a = min(chunk[i][out_len[i] - 1], g)
                    n = min(a + 1, max_new - out_len[i])
                    out_len[i] += n
                    tokens += n
                    done[i] = out_len[i] >= max_new
                    accs.append(a)
                total_ms += _ms(round_ms, g + 1)
                used[g + 1] += 1
                if policy is not None:
                    pending.append((g, accs if g else []))
        tokens += len(chunk)  # the prefill's first token of each row (not timed)
    return {"tokens_per_second": tokens / total_ms * 1e3, "block_lengths": dict(sorted(
        used.items()))}


def policy_from(args: list[str]) -> AdaptiveConfig:
    """key=value pairs of AdaptiveConfig fields (numbers and booleans)."""
    kw = {}
    for a in args:
        k, v = a.split("=", 1)
        kw[k] = v.lower() == "true" if v.lower() in ("true", "false") else (
            int(v) if v.lstrip("-").isdigit() else float(v))
    return AdaptiveConfig(**kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("traces", help="a(t) of every dev prompt (CPU, fp32)")
    t.add_argument("--target", default=str(fixture("code-target")))
    t.add_argument("--draft", default=str(fixture("code-target-dflash-b16")))
    t.add_argument("--prompts", default=str(DEV_PROMPTS))
    t.add_argument("--limit", type=int, default=None)
    t.add_argument("--max-new-tokens", type=int, default=256)
    t.add_argument("--out", required=True)
    s = sub.add_parser("simulate", help="plain / fixed / adaptive tokens/s per batch size")
    s.add_argument("--traces", required=True)
    s.add_argument("--results", required=True, help="gpu_speedup.py adaptive results.json")
    s.add_argument("--policy", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="AdaptiveConfig fields (default: the run's reads_every, else defaults)")
    s.add_argument("--k", type=int, default=8, help="prompts per batch row (gpu_speedup's 8)")
    s.add_argument("--read-ms", type=float, default=0.0, help="cost of one host read")
    s.add_argument("--out", default=None)
    args = p.parse_args()
    if args.cmd == "traces":
        from dflash_plugin.checkpoint import load_drafter
        from dflash_plugin.loading import load_target
        model, tok = load_target(args.target, "cpu", torch.float32)
        drafter = load_drafter(args.draft, "cpu", torch.float32)
        prompts = [tok(x).input_ids for x in read_prompts(args.prompts)][:args.limit]
        rows = traces(model, drafter, prompts, args.max_new_tokens)
        write_json(args.out, {"max_new_tokens": args.max_new_tokens, "traces": rows})
        print(f"{len(rows)} traces, mean a(t) {sum(map(sum, rows)) / sum(map(len, rows)):.2f}")
        return
    tr = json.loads(Path(args.traces).read_text())
    every, max_new = tr["traces"], tr["max_new_tokens"]
    res = json.loads(Path(args.results).read_text())
    out = []
    for s_ in res["adaptive"]:
        b = s_["batch"]
        cfg = policy_from([f"reads_every={res['args'].get('adaptive_reads_every', 16)}"]
                          + args.policy)
        n = b * args.k
        rows = (every * -(-n // len(every)))[:n]
        rms = {int(q): v for q, v in s_["round_ms"].items()}
        measured = {k: r for k, r in zip(("plain", "fixed", "adaptive"), (
            next(r for r in res["rows"] if r["row"] == f"ours {name} (adaptive set)"
                 and r["batch"] == b) for name in ("AR", "DFlash fixed", "adaptive")))}
        pre = {k: r["prefill_seconds"] * 1e3 / len(r["chunk_seconds"])
               for k, r in measured.items()}
        kw = dict(read_ms=args.read_ms)
        sim = {"plain": simulate(rows, {1: s_["plain_decoder_round_ms"]}, b, 1, max_new,
                                 fixed=1, prefill_ms=pre["plain"], **kw),
               "fixed": simulate(rows, rms, b, 16, max_new, fixed=16, prefill_ms=pre["fixed"],
                                 **kw),
               "adaptive": simulate(rows, rms, b, 16, max_new, cfg=cfg,
                                    prefill_ms=pre["adaptive"], **kw)}
        tps = {k: v["tokens_per_second"] for k, v in sim.items()}
        row = {"batch": b, "simulated_tokens_per_second": {k: round(v, 1) for k, v in
                                                           tps.items()},
               "measured_tokens_per_second": s_["tokens_per_second"],
               "simulated_adaptive_over_best": round(tps["adaptive"] / max(tps["plain"],
                                                                          tps["fixed"]), 4),
               "measured_adaptive_over_best": s_["adaptive_over_best"],
               "simulated_block_lengths": sim["adaptive"]["block_lengths"],
               "measured_block_lengths": s_["block_lengths"]}
        out.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        write_json(args.out, {"policy": args.policy, "read_ms": args.read_ms, "rows": out})


if __name__ == "__main__":
    main()
