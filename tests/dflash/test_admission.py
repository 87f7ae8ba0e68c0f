"""`dflash_plugin.admission`: the hold size by cost, on cases computed by hand, and read from a
real `LaunchLedger` fed with launches."""

import pytest

from dflash_plugin.adaptive import LaunchLedger
from dflash_plugin.admission import hold_size, hold_size_from_ledger
from dflash_plugin.errors import ConfigError


def rate(b, d, p, a, k):
    return (b - (k - 1) / 2) / (d + a * p / k)


def test_hold_size_by_hand():
    """32 in flight, D 2.5, P 6, a 1.1: R(7) = 29 / 3.443 = 8.42, R(8) = 28.5 / 3.325 = 8.57,
    best R(11) = 27 / 3.1 = 8.71; 8.57 is within 3 % of it, 8.42 not: K = 8. 4 in flight,
    a 0.14: R(1) = 4 / 2.84 = 1.408, best R(2) = 3.5 / 2.42 = 1.446, within 3 %: K = 1."""
    assert rate(32, 2.5, 6, 1.1, 8) == pytest.approx(8.571, abs=1e-3)
    assert rate(32, 2.5, 6, 1.1, 11) == pytest.approx(8.710, abs=1e-3)
    assert hold_size(2.5, 6, 1.1, 32) == 8
    assert hold_size(2.5, 6, 1.1, 32, tol=0) == 11
    assert hold_size(2.0, 6, 0.14, 4) == 1 and hold_size(2.0, 6, 0.14, 4, tol=0) == 2
    assert hold_size(2.5, 6, 1.1, 32, k_max=4) == 4  # capped
    # nothing arrives, a free pass, one request in flight: no reason to hold
    assert hold_size(2.5, 6, 0, 32) == hold_size(2.5, 0, 1.1, 32) == hold_size(2.5, 6, 1, 1) == 1
    with pytest.raises(ConfigError, match="step_ms"):
        hold_size(0, 6, 1, 32)
    with pytest.raises(ConfigError, match="pass_ms"):
        hold_size(2.5, -1, 1, 32)


def test_the_ledger_rate_is_the_recent_admissions_per_decode_launch():
    led = LaunchLedger(decay=0.5)
    for t, kind, n in [(0.0, "d", 8), (0.001, "p", 2), (0.002, "p", 1), (0.003, "d", 8),
                       (0.004, "d", 8)]:
        led.launch(t, kind, n)
    # decode launches see 0, then 2 + 1 (two passes between), then 0 admissions
    assert led.rate == pytest.approx(0.5 * (0.5 * 0 + 0.5 * 3) + 0.5 * 0)


def ledger(step_s, pass_s, dp_s, admit_every, steps, admit=1):
    """A ledger of `steps` decode launches `step_s` apart, a prefill of `admit` requests after
    every `admit_every`-th (the decode -> prefill interval `dp_s`, the pass `pass_s`)."""
    led, t = LaunchLedger(gap_s=1.0, decay=0.9), 0.0
    for i in range(steps):
        led.launch(t, "d", 32)
        if i % admit_every == admit_every - 1:
            t += dp_s
            led.launch(t, "p", admit)
            t += pass_s
        else:
            t += step_s
    return led


def test_hold_size_from_the_ledger():
    """Steps of 2.5 ms, a pass after each (a decode followed by a prefill 3.5 ms, the pass
    5 ms: P = 5 + 1 = 6 ms), one admission per step: as `hold_size(2.5, 6, ~1, 32)`; too few
    passes or steps yet: 1."""
    led = ledger(0.0025, 0.005, 0.0035, 1, 200)
    assert led.rate == pytest.approx(1.0, abs=1e-6)
    assert led.n["p."] == 199 and led.n["dd"] == 0  # every decode is followed by a prefill
    assert hold_size_from_ledger(led, 32) == 1  # no decode -> decode interval measured
    led = ledger(0.0025, 0.005, 0.0035, 2, 400, admit=2)  # every other step: a = 1 again
    # the rate swings 0.95-1.05 (2 admitted at every other decode launch); after the last
    # launch (none admitted before it) it is at the low end, where K = 7 (8 from a = 1.05)
    assert led.rate == pytest.approx(0.947, abs=1e-3)
    assert hold_size_from_ledger(led, 32) == hold_size(2.5, 5 + 1, led.rate, 32) == 7
    assert hold_size_from_ledger(ledger(0.0025, 0.005, 0.0035, 2, 19, admit=2), 32) == 1
