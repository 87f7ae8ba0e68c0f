"""How many requests to admit together, by cost (`DFLASH_BATCH_ADMISSION=cost`; the hook is
`engines.sglang_admission`). Every admission into a DFLASH-family server is a prefill pass of
its own, which costs the running batch about two decode steps on the bundled fixture; holding
admissions until K requests wait cuts the passes K-fold but leaves the held requests' slots
idle. At a steady load of B requests in flight, a arrivals per decode step, a decode step of D
ms and a pass adding P ms, batches of K leave (K - 1) / 2 slots idle on average and make a / K
passes per step, so the server decodes

    R(K) = (B - (K - 1) / 2) / (D + a P / K)    request-steps per ms.

`hold_size` takes the smallest K within `tol` of the best R (holding also delays a
request's first token, so no more than pays); 1 admits every request at once. On an H100
(2026-12-06) at 32 requests: D about 2.5 ms, P about 6 ms, a about 1.1: K = 8 (R 8.57 against
3.52 at K = 1); at 4 requests (a about 0.14) K = 1. D, P and a come from the adaptive server's
`LaunchLedger`: the mean decode-to-decode interval, the mean prefill-to-next interval plus what
a decode followed by a prefill takes over D, and its decayed admissions per decode launch.
Measured (H100, 2026-12-07, BENCHMARKS.md "Admission by cost"): 6.8-7.5 requests per pass at
32 requests and 22,420 -> 26,773-28,230 tok/s, where a fixed K = 4 made 28,576-28,732: the
model's P over-states what a pass of several requests adds, so its K is about twice a K that
did as well (only 0, 4 and this K were measured)."""

from __future__ import annotations

from .errors import require


def hold_size(step_ms: float, pass_ms: float, arrivals: float, clients: int,
              k_max: int = 16, tol: float = 0.03) -> int:
    """The smallest K in 1..min(k_max, clients) whose R(K) (module docstring) is within `tol`
    of the largest; 1 when nothing arrives, a pass costs nothing or fewer than 2 are in
    flight."""
    require(step_ms > 0, "step_ms", f"must be > 0, got {step_ms}")
    require(pass_ms >= 0 and arrivals >= 0, "pass_ms, arrivals",
            f"must be >= 0, got {pass_ms}, {arrivals}")
    require(k_max >= 1 and tol >= 0, "k_max, tol", f"must be >= 1 and >= 0, got {k_max}, {tol}")
    ks = range(1, max(1, min(k_max, int(clients))) + 1)
    rate = {k: (clients - (k - 1) / 2) / (step_ms + arrivals * pass_ms / k) for k in ks}
    best = max(rate.values())
    return next(k for k in ks if rate[k] >= best / (1 + tol))


def hold_size_from_ledger(ledger, clients: int, k_max: int = 16, min_steps: int = 50,
                          min_passes: int = 10) -> int:
    """`hold_size` from a `LaunchLedger`'s mean intervals and its decayed admission rate; 1
    until it has `min_steps` decode-to-decode intervals and `min_passes` prefill passes."""
    if ledger.n["dd"] < min_steps or ledger.n["p."] < min_passes:
        return 1
    step, dp = ledger.mean_ms("dd"), ledger.mean_ms("dp")
    extra = max(0.0, dp - step) if dp is not None else 0.0
    return hold_size(step, ledger.mean_ms("p.") + extra, ledger.rate, clients, k_max)
