"""`benchmarks/closed_loop_sim.py`: the mean batch of a closed loop, on cases counted by hand."""

import pytest

from tests.bench_script import load

sim = load("closed_loop_sim")


def test_mean_batch_counted_by_hand():
    assert sim.mean_batch([5] * 8, 4) == 4.0  # two waves that finish together: always full
    # 2 in flight: 1 and 4 steps; the third (1 step) replaces the first in step 2, then the
    # 4-step request runs alone: steps 1-4 hold 2, 2, 1, 1 requests
    assert sim.mean_batch([1, 4, 1], 2) == pytest.approx(6 / 4)
    assert sim.mean_batch([4], 8) == 1.0  # fewer requests than slots


def test_request_steps_spread_lengths_and_acceptance():
    plain = sim.request_steps(8, 128, 1.0, 0.0, 0.0)
    assert plain == [128] * 8
    spread = sim.request_steps(64, 128, 1.0, 0.0, 0.5)
    assert min(spread) >= 64 and max(spread) <= 192 and len(set(spread)) > 32
    spec = sim.request_steps(64, 128, 4.4, 0.3, 0.0)
    assert min(spec) >= round(128 / (4.4 * 1.3)) and max(spec) <= round(128 / (4.4 * 0.7))
