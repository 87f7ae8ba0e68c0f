"""`benchmarks/ledger_intervals.py`: per-interval ledger figures from two cumulative log lines,
the lines written from a real `LaunchLedger` in the worker's format, counted by hand."""

import pytest

from dflash_plugin.adaptive import LaunchLedger
from tests.bench_script import load

li = load("ledger_intervals")


def line(ledger: LaunchLedger, steps: int) -> str:
    return (f"[2026-12-06 21:49:41] DFLASH_ADAPTIVE: {steps} decode steps per block length "
            f"{{16: {steps}}}; step ms now {{32: {{1: 1.9, 16: 2.4}}}}; survival [0.7, 0.5]; "
            f"launches {ledger.summary()}; memory: allocator retries 0\n")


def test_two_lines_give_the_interval_between_them():
    led = LaunchLedger()
    t = 0.0
    for _ in range(3):  # 3 decode launches of 4 requests, 2 ms apart
        led.launch(t, "d", 4)
        t += 0.002
    first = line(led, 3)
    led.launch(t, "p", 2)  # a prefill pass of 2 requests, then 3 decode launches of 6
    t += 0.005
    for _ in range(2):
        led.launch(t, "d", 6)
        t += 0.003
    led.launch(t, "d", 6)
    sums = [li.parse(first), li.parse("unrelated line\n"), li.parse(line(led, 6))]
    assert sums[1] is None
    (got,) = li.intervals([s for s in sums if s])
    # decode launches 3 then 6, of 4, 4, 4 then 6, 6, 6 requests: 3 more of 6 each; 1 pass of
    # 2; wall time added: the decode -> prefill interval (2 ms), the pass to the next launch
    # (5 ms), two decode -> decode (3 ms each): 13 ms over 3 decode launches
    assert (got["decodes"], got["passes"]) == (3, 1)
    assert got["per_decode"] == pytest.approx(6.0) and got["per_prefill"] == pytest.approx(2.0)
    assert got["ms_per_decode"] == pytest.approx(13 / 3)


def test_lines_before_the_sums_are_read_from_the_means():
    old = ("[t] DFLASH_ADAPTIVE: 200 decode steps per block length {16: 200}; launches "
           "{'dd': {'n': 150, 'ms': 2.0, 'share': 0.5}, 'dp': {'n': 50, 'ms': 3.0, 'share': 0.2}, "
           "'p.': {'n': 50, 'ms': 4.0, 'share': 0.3}, 'per_prefill': 2.5, 'per_decode': 30.0}; "
           "memory: x")
    got = li.parse(old)
    assert (got["decodes"], got["rows"], got["admitted"]) == (200, 6000.0, 125.0)
    assert got["ms"] == pytest.approx(150 * 2.0 + 50 * 3.0 + 50 * 4.0)
