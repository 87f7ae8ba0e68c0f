"""The time of one decode step or speculative round of a started engine at batch B (`gpu_engines.py
round-cost`, B copies of one prompt sent together): after an untimed warm-up, per repeat the time of
`decode_tokens` new tokens minus the time of 1 (the prefills and their first tokens), divided by the
decode steps (plain) or by the rounds the engine counted per request (speculative: DFlash,
DFLASH_TREE); medians over the repeats. At B > 1 keep the prompts short enough that the B prefills
fit one chunk, or later prefills overlap the first decode steps. Acceptance barely matters here
(random weights accept ~nothing): it measures the cost of a round, the fixture's tau gives its gain.
"""

from __future__ import annotations

import statistics
import time

from .engine_rows import Sampling, tau_of


def median(xs):  # of the values that are not None; None if none
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def round_cost(runner, ids: list[int], decode_tokens: int, repeats: int,
               speculative: bool, batch: int = 1) -> dict:
    """`repeats_detail`, `per_round_s` and `tokens_per_round` of `runner` (a `start_engine`
    runner) on `batch` copies of one prompt of token ids `ids`, decoding together."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")

    def timed(n: int):
        before = runner.counters()
        t0 = time.perf_counter()
        done = runner.run([ids] * batch, [Sampling(0.0, n, None)] * batch, batch)
        return time.perf_counter() - t0, tau_of(before, runner.counters(), done), done

    for n in (1, decode_tokens, 1, decode_tokens):  # warm-up, untimed
        timed(n)
    reps = []
    steps = decode_tokens - 1  # new tokens after the prefill's first one
    for _ in range(repeats):
        t1, _, _ = timed(1)
        tn, tau, done = timed(decode_tokens)
        rounds = tau.get("rounds") if speculative else steps
        rounds = rounds / batch if speculative and rounds else rounds  # per request: in step
        reps.append({"t1_s": t1, "tn_s": tn, "generated": len(done[0].token_ids),
                     "rounds": rounds, "per_round_s": (tn - t1) / max(rounds or steps, 1),
                     "tau": tau.get("tau")})
    return {"repeats_detail": reps, "per_round_s": median([r["per_round_s"] for r in reps]),
            "tokens_per_round": median([steps / r["rounds"] for r in reps if r["rounds"]])}
