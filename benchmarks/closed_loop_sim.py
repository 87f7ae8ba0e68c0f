"""How full a closed-loop row's decode batches run, by simulation (no engine, no timing): the
benchmarks' rows (`dflash_plugin.tune.measure_cells`) serve waves x c requests with c in flight
and then drain, so their last requests run with ever fewer beside them. Requests that finish
together (plain decoding, equal lengths) drain at once; requests that finish at different
steps (speculation: each request's acceptance differs; or spread output lengths) leave a tail
of small batches. This counts the mean requests per decode step of such a loop, ignoring the
time a finished request's replacement takes to arrive and be admitted (so real batches run
emptier still).

    python benchmarks/closed_loop_sim.py    # the table in BENCHMARKS.md ("Host cuts")
"""

from __future__ import annotations

import random


def mean_batch(steps: list[int], concurrency: int) -> float:
    """Mean requests per step of a closed loop over requests of `steps[i]` decode steps each,
    `concurrency` in flight, a finished request replaced in the same step while any are left."""
    queue = iter(steps)
    running = [s for _, s in zip(range(concurrency), queue)]
    busy = t = 0
    while running:
        busy, t = busy + len(running), t + 1
        left = [r - 1 for r in running if r > 1]
        running = left + [s for _, s in zip(range(len(running) - len(left)), queue)]
    return busy / t


def request_steps(n: int, tokens: int, tau: float, tau_spread: float, len_spread: float,
                  seed: int = 0) -> list[int]:
    """Decode steps of n requests: output lengths from tokens (1 - len_spread) to tokens (1 +
    len_spread) (the rows' interleaved spread), tokens per step tau, each request's own tau up
    to +-tau_spread of it (one per prompt of 64, as the dev prompts cycle)."""
    rng = random.Random(seed)
    taus = [tau * (1 + tau_spread * rng.uniform(-1, 1)) for _ in range(64)]
    lens = [round(tokens * (1 + len_spread * (2 * ((i * 0.6180339887) % 1) - 1)))
            for i in range(n)]
    return [max(1, round(lens[i] / taus[i % 64])) for i in range(n)]


def main() -> None:
    c = 32
    print(f"| closed loop at {c} requests, mean requests per decode step | 2 waves | 4 waves "
          f"| 16 waves |\n|---|---|---|---|")
    rows = [("plain, 128 tokens", 1.0, 0.0, 0.0), ("plain, 64-192 tokens", 1.0, 0.0, 0.5),
            ("speculation, tau 4.4 +-15 %, 128 tokens", 4.4, 0.15, 0.0),
            ("speculation, tau 4.4 +-30 %, 128 tokens", 4.4, 0.3, 0.0),
            ("speculation, tau 4.4 +-30 %, 64-192 tokens", 4.4, 0.3, 0.5)]
    for name, tau, ts, ls in rows:
        got = [mean_batch(request_steps(w * c, 128, tau, ts, ls), c) for w in (2, 4, 16)]
        print(f"| {name} | " + " | ".join(f"{g:.1f}" for g in got) + " |")


if __name__ == "__main__":
    main()
