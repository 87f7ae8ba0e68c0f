"""The serving policy of SGLang's DFLASH_ADAPTIVE (`adaptive.ServerPolicy`), engine-free: the
nearest measured concurrency of a batch size, step times from a `dflash tune` report
(`engines.sglang_adaptive.step_times`), live step times, shared survival, probes."""

import dataclasses
import json
from pathlib import Path

import pytest

from dflash_plugin.adaptive import (
    AdaptiveConfig,
    LaunchLedger,
    ServerPolicy,
    StepClock,
    cap_plain,
    nearest_row,
)
from dflash_plugin.engines.sglang_adaptive import PROBE_STEPS, SERVER_CONFIG, step_times
from dflash_plugin.errors import ConfigError

TUNE_SGLANG = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu-engines"
               / "tune-sglang.json")
ROWS = [1, 4, 8, 16, 32, 64]


def _tune_doc(cells, **kw):
    return {"kind": "dflash-tune", "engine": "sglang", "cells": cells, **kw}


SMALL_TUNE = _tune_doc([{"k": 0, "concurrency": 1, "tokens_per_s": 800.0, "tau": None},
                        {"k": 15, "concurrency": 1, "tokens_per_s": 1600.0, "tau": 5.0}])


@pytest.mark.parametrize("rows,bs,want", [
    (ROWS, 1, 1),
    (ROWS, 2, 1),  # log 2 is as far from log 1 as from log 4: the smaller
    (ROWS, 3, 4),
    (ROWS, 6, 8),
    (ROWS, 100, 64),  # past the largest: the largest
    ([64, 8, 1], 5, 8),  # order of the rows does not matter
    ([64, 16], 32, 16),  # an exact tie in log scale, rows unsorted: the smaller
    ([2, 8], 4, 2),
])
def test_nearest_row_table(rows, bs, want):
    """The measured concurrency nearest in log scale, ties to the smaller."""
    assert nearest_row(rows, bs) == want


def test_nearest_row_bad_input():
    """No rows, or a batch size below 1, is a ConfigError naming the argument."""
    with pytest.raises(ConfigError, match="rows"):
        nearest_row([], 4)
    with pytest.raises(ConfigError, match="batch_size"):
        nearest_row([1, 4], 0)


def test_step_times_from_a_small_report():
    """ms = 1e3 * c * tau / tokens_per_s, q = k + 1, plain counting tau 1; max_q drops longer q."""
    assert step_times(SMALL_TUNE) == {1: pytest.approx({1: 1.25, 16: 3.125})}
    assert step_times(SMALL_TUNE, max_q=16) == step_times(SMALL_TUNE)  # q <= max_q kept
    assert step_times(SMALL_TUNE, max_q=8) == {1: pytest.approx({1: 1.25})}


def test_step_times_of_the_recorded_sglang_tune():
    """The H200 tune report: every row's q = k + 1 with the formula's times; it seeds a policy."""
    doc = json.loads(TUNE_SGLANG.read_text())
    rows = step_times(doc)
    assert sorted(rows) == ROWS and all(sorted(r) == [1, 8, 16] for r in rows.values())
    for cell in doc["cells"]:
        tau = 1.0 if cell["k"] == 0 else cell["tau"]
        want = 1e3 * cell["concurrency"] * tau / cell["tokens_per_s"]
        assert rows[cell["concurrency"]][cell["k"] + 1] == pytest.approx(want)
    assert rows[1][1] == pytest.approx(1e3 / 824.5225592760106)
    assert all(sorted(r) == [1, 8] for r in step_times(doc, max_q=15).values())
    assert ServerPolicy(AdaptiveConfig(), rows, max_q=16).blocks() == [1, 8, 16]


def test_step_times_drops_cells_without_tau_and_empty_rows():
    """A k > 0 cell without tau has no step time; a row left empty is left out."""
    doc = _tune_doc(SMALL_TUNE["cells"] + [
        {"k": 15, "concurrency": 4, "tokens_per_s": 3000.0, "tau": None}])
    assert sorted(step_times(doc)) == [1]


@pytest.mark.parametrize("doc,max_q,match", [
    ({**SMALL_TUNE, "kind": "dflash-bench"}, None, "kind dflash-tune"),
    ([SMALL_TUNE], None, "kind dflash-tune"),  # not a dict
    ({**SMALL_TUNE, "engine": "vllm"}, None, "engine 'vllm'"),
    ({k: v for k, v in SMALL_TUNE.items() if k != "engine"}, None, "engine None"),
    (_tune_doc([{"k": 0, "concurrency": 1, "tokens_per_s": 800.0}]), None, "lacks a field"),
    (_tune_doc([7]), None, "lacks a field"),  # a cell that is not an object
    (_tune_doc([]), None, "no measured step time"),
    (_tune_doc([SMALL_TUNE["cells"][1]]), 8, "block length <= 8"),  # only q = 16 measured
    (_tune_doc([{"k": 0, "concurrency": 1, "tokens_per_s": "fast", "tau": None}]), None,
     "bad cell"),
    (_tune_doc([{"k": 0, "concurrency": 0, "tokens_per_s": 800.0, "tau": None}]), None,
     "bad cell"),
])
def test_step_times_bad_input(doc, max_q, match):
    """Wrong kind or engine, malformed cells, nothing at q <= max_q: ConfigError naming the
    SGLang option."""
    with pytest.raises(ConfigError, match=f"speculative_adaptive_config.*{match}"):
        step_times(doc, max_q)


LAUNCH = {1: 1.0, 8: 1.2, 16: 1.4}  # speculation cheap
COMPUTE = {1: 1.0, 8: 8.0, 16: 16.0}  # a round costs q plain steps


def test_server_policy_all_accepted_takes_the_longest_q():
    """Every draft accepted, at a row where long rounds are cheap: q = max."""
    policy = ServerPolicy(AdaptiveConfig(), {1: LAUNCH}, max_q=16)
    for _ in range(20):
        policy.observe(1, 16, [15])
    assert policy.choose(1) == 16


def test_server_policy_no_acceptance_goes_plain():
    """The prior picks speculation; after enough rounds with no accepted draft, q = 1."""
    policy = ServerPolicy(AdaptiveConfig(), {1: LAUNCH}, max_q=16)
    assert policy.choose(1) == 16  # prior s_k = 0.5
    for _ in range(60):
        policy.observe(1, 16, [0, 0])
    assert policy.choose(1) == 1


def test_server_policy_rows_have_own_times_and_share_survival():
    """Rows decide by their own times (bs 6 -> row 8), but acceptance seen at one row counts
    at every row; `timed` changes only its own row."""
    policy = ServerPolicy(AdaptiveConfig(), {1: dict(LAUNCH), 8: dict(COMPUTE)}, max_q=16)
    for _ in range(20):
        policy.observe(1, 16, [15])
    assert policy.choose(1) == 16  # cheap long rounds
    assert policy.choose(6) == 1  # row 8: compute-bound, plain at the same acceptance
    policy.timed(1, 16, 50.0)  # a batch size's first step at a q: a warm-up, left out
    policy.timed(1, 16, 2.0)
    assert policy.times() == {1: {1: 1.0, 8: 1.2, 16: 2.0}, 8: COMPUTE}
    shared = ServerPolicy(AdaptiveConfig(), {1: LAUNCH, 8: LAUNCH}, max_q=16)
    for _ in range(60):
        shared.observe(8, 16, [0] * 8)  # rejections seen at row 8 only
    assert shared.choose(1) == 1  # row 1 (never observed) goes plain too; its prior says 16


def test_server_policy_observe_takes_the_issued_q():
    """A step issued at q drafted q - 1 positions: later ones keep the prior; q = 1 drafts none."""
    policy = ServerPolicy(AdaptiveConfig(decay=0.5), {1: LAUNCH}, max_q=16)
    policy.observe(1, 1, [0])
    assert policy.survival.values() == [0.5] * 15
    for _ in range(10):
        policy.observe(1, 8, [7])  # positions 1-7 drafted and accepted
    v = policy.survival.values()
    assert v[6] > 0.99 and v[7:] == [0.5] * 8


def test_server_policy_timed_replaces_then_averages_and_drops_outliers():
    """The first sample of a (batch size, q) is a warm-up, left out; the next one replaces the
    tune's time; later ones make a decayed mean (0.9); a sample over 4x the mean, or not
    positive, is left out."""
    policy = ServerPolicy(AdaptiveConfig(), {1: {1: 1.0, 16: 9.0}}, max_q=16)
    policy.timed(1, 1, 858.0)  # the first step at q = 1: kernels compile
    assert policy.times()[1][1] == 1.0
    policy.timed(1, 1, 2.0)
    assert policy.times()[1][1] == 2.0
    policy.timed(1, 1, 8.5)  # > 4 x 2.0: a host pause
    policy.timed(1, 1, 0.0)
    assert policy.times()[1][1] == 2.0
    policy.timed(1, 1, 8.0)  # exactly 4x is kept
    assert policy.times()[1][1] == pytest.approx((0.9 * 2.0 + 8.0) / 1.9)
    assert policy.times()[1][16] == 9.0


def test_cap_plain_table():
    """The plain step costs at most 0.95x the cheapest speculative round; others unchanged."""
    assert cap_plain({1: 44.3, 8: 20.0, 16: 30.1}) == {1: 19.0, 8: 20.0, 16: 30.1}
    assert cap_plain({1: 44.3, 8: 20.0}, below=1.0) == {1: 20.0, 8: 20.0}
    assert cap_plain({1: 5.0, 8: 17.6}) == {1: 5.0, 8: 17.6}
    assert cap_plain({1: 5.0}) == {1: 5.0}
    assert cap_plain({8: 3.0, 16: 2.0}) == {8: 3.0, 16: 2.0}
    with pytest.raises(ConfigError, match="below"):
        cap_plain({1: 1.0}, below=0.0)


def test_server_policy_a_plain_time_read_too_high_does_not_lock_plain_out():
    """The H200 run of 2026-12-04 (Qwen3-8B shape, nothing accepted, 64 requests): one live
    plain step read 44 ms against 17.6 for q = 8, so the row ran q = 8 for good (plain was never
    re-measured). Capped at the cheapest speculative round, plain wins the tie, is measured
    again, and its true time replaces the bad one."""
    policy = ServerPolicy(AdaptiveConfig(), {64: {1: 2.2, 8: 11.6, 16: 9.4}}, max_q=16)
    for _ in range(60):
        policy.observe(64, 16, [0] * 64)
    for q, ms in ((8, 17.6), (16, 30.1), (1, 44.3)):
        policy.timed(64, q, ms)  # warm-up, left out
        policy.timed(64, q, ms)
    assert policy.times()[64] == {1: pytest.approx(0.95 * 17.6), 8: 17.6, 16: 30.1}
    assert policy.choose(64) == 1
    for _ in range(40):
        policy.timed(64, 1, 13.0)
    assert policy.times()[64][1] < 14.0
    assert policy.choose(64) == 1


def test_server_policy_timed_ignores_unmeasured_q():
    """A live time of a q the row does not have (or that is over max_q) is ignored."""
    policy = ServerPolicy(AdaptiveConfig(), {1: {1: 1.0, 16: 3.0}, 4: {1: 1.0, 8: 2.0}}, max_q=8)
    policy.timed(1, 8, 1.0)  # row 1 has no q = 8
    policy.timed(1, 16, 1.0)  # over max_q
    policy.timed(4, 4, 1.0)
    assert policy.times() == {1: {1: 1.0}, 4: {1: 1.0, 8: 2.0}}
    assert policy.blocks() == [1, 8]


def test_server_policy_live_plain_time_flips_to_speculation():
    """Tune: plain 1 ms, q 16 3 ms, tau ~2.5 -> plain; plain measured at 3 ms live -> q 16."""
    policy = ServerPolicy(AdaptiveConfig(), {1: {1: 1.0, 16: 3.0}}, max_q=16)
    for _ in range(100):
        policy.observe(1, 16, [1, 2])  # s_1 = 1, s_2 = 0.5, the rest 0: E(16) ~ 2.5
    assert 1 + sum(policy.survival.values()) == pytest.approx(2.5, abs=0.01)
    assert policy.choose(1) == 1
    policy.timed(1, 1, 3.0)  # warm-up, left out
    assert policy.choose(1) == 1
    policy.timed(1, 1, 3.0)
    assert policy.choose(1) == 16


def test_server_policy_probe_is_not_repeated_before_its_readback():
    """While plain, one probe at the longest q after `spacing` plain steps; the next choice is
    plain again although the probe's acceptance is not read back yet."""
    cfg = AdaptiveConfig(probe_every=4, probe_overhead=0.5)
    policy = ServerPolicy(cfg, {1: LAUNCH}, max_q=16)
    for _ in range(60):
        policy.observe(1, 16, [0])
    assert policy.policies[1].spacing(1) == 4
    for _ in range(3):
        policy.observe(1, 1, [0])  # plain steps: nothing drafted
    assert policy.choose(1) == 1
    policy.observe(1, 1, [0])
    assert policy.choose(1) == 16  # the probe
    assert policy.choose(1) == 1  # not again on the very next step
    assert policy.choose(1) == 1


def test_server_policy_blocks_is_the_union_of_rows():
    """blocks(): every q of any row, sorted, q <= max_q."""
    rows = {1: {1: 1.0, 16: 2.0}, 8: {1: 1.0, 4: 1.5, 8: 2.0}}
    assert ServerPolicy(AdaptiveConfig(), rows, max_q=16).blocks() == [1, 4, 8, 16]
    assert ServerPolicy(AdaptiveConfig(), rows, max_q=8).blocks() == [1, 4, 8]


def test_server_policy_bad_input():
    """No rows, max_q < 1, or a row with no q <= max_q: ConfigError."""
    with pytest.raises(ConfigError, match="rows"):
        ServerPolicy(AdaptiveConfig(), {}, max_q=16)
    with pytest.raises(ConfigError, match="max_q"):
        ServerPolicy(AdaptiveConfig(), {1: {1: 1.0}}, max_q=0)
    with pytest.raises(ConfigError, match="round_ms"):
        ServerPolicy(AdaptiveConfig(), {1: {1: 1.0}, 8: {16: 2.0}}, max_q=8)


def test_server_policy_probe_steps_issues_each_probe_twice():
    """probe_steps=2: a probe is two consecutive steps at the longest q, then plain again; the
    spacing doubles with the probe's length (it costs twice)."""
    cfg = AdaptiveConfig(probe_every=4, probe_overhead=0.5)
    one = ServerPolicy(cfg, {1: {1: 1.0, 16: 1.5}}, max_q=16)
    two = ServerPolicy(cfg, {1: {1: 1.0, 16: 1.5}}, max_q=16, probe_steps=2)
    for policy in (one, two):
        for _ in range(60):
            policy.observe(1, 16, [0])
    assert two.policies[1].spacing(1) == 4  # probe_every still binds
    slow = ServerPolicy(cfg, {1: {1: 1.0, 16: 4.0}}, max_q=16, probe_steps=2)
    assert slow.policies[1].spacing(1) == 4  # q = 16's time is the tune's: probe_every
    for _ in range(2):  # a warm-up sample (left out), then the live one
        slow.timed(1, 16, 4.0)
    assert slow.policies[1].spacing(1) == 12  # 2 x (4 - 1) / 0.5
    for _ in range(4):
        two.observe(1, 1, [0])
    assert [two.choose(1) for _ in range(3)] == [16, 16, 1]
    with pytest.raises(ConfigError, match="probe_steps"):
        ServerPolicy(cfg, {1: {1: 1.0}}, max_q=16, probe_steps=0)


def test_step_clock_counts_an_interval_only_between_two_steps_alike():
    """Launch to launch counts for (bs, q) only where the two steps before had that (bs, q)
    and the launching step the same bs; a reset (prefill) forgets both."""
    clock = StepClock()
    assert clock.launch(0.000, 4, 1) is None
    assert clock.launch(0.005, 4, 1) is None  # one step before: not enough
    assert clock.launch(0.010, 4, 16) == (4, 1, pytest.approx(5.0))
    assert clock.launch(0.016, 4, 16) is None  # steps 1 and 16 before: mixed
    assert clock.launch(0.023, 4, 1) == (4, 16, pytest.approx(7.0))
    assert clock.launch(0.028, 8, 1) is None  # the launching step has another bs
    clock.reset()
    assert clock.launch(0.030, 8, 1) is None and clock.launch(0.031, 8, 1) is None


def test_launch_ledger_charges_intervals_by_the_kinds_around_them():
    """Decode, decode, prefill of 3, decode, an idle gap, decode, prefill of 1, decode: 'dd'
    2 ms, 'dp' 3 and 0 ms, 'p.' 5 and 4 ms, the gap left out, 2 requests per pass; the five
    decode launches of 4, 4, 7, 7 and 8 requests: 6 per decode launch."""
    led = LaunchLedger(gap_s=0.05)
    for t, kind, n in [(0.000, "d", 4), (0.002, "d", 4), (0.005, "p", 3), (0.010, "d", 7),
                       (1.000, "d", 7), (1.000, "p", 1), (1.004, "d", 8)]:
        led.launch(t, kind, n)
    got = led.summary()
    assert got["dd"]["n"] == 1 and got["dd"]["ms"] == pytest.approx(2.0)
    assert got["dp"]["n"] == 2 and got["dp"]["ms"] == pytest.approx(1.5)  # 3 ms and 0 ms
    assert got["p."]["n"] == 2 and got["p."]["ms"] == pytest.approx(4.5)
    assert got["per_prefill"] == 2.0 and got["per_decode"] == 6.0
    assert got["sums"] == {"decodes": 5, "rows": 30, "admitted": 4}
    assert sum(v["share"] for k, v in got.items() if k in ("dd", "dp", "p.")) == \
        pytest.approx(1.0)
    assert LaunchLedger().summary()["dd"] == {"n": 0, "ms": None, "share": None}
    assert LaunchLedger().summary()["per_decode"] is None
    with pytest.raises(ConfigError, match="kind"):
        led.launch(2.0, "x")


def _overlapped_server(policy, gpu_ms, steps, host_ms=0.5, accepted=0):
    """An overlapped schedule (SGLang's): step N launches after its host work and after step
    N - 2's results are back (the scheduler waits for N - 1 only once N is launched). Returns
    the q of each step; every row of every step accepts `accepted` drafts (at most q - 1)."""
    clock, launch, done, qs = StepClock(), 0.0, [0.0, 0.0], []
    for _ in range(steps):
        q = policy.choose(64)
        if sample := clock.launch(launch / 1e3, 64, q):
            policy.timed(*sample)
        start = max(launch + host_ms, done[-1])  # the GPU runs the step after the previous
        done.append(start + gpu_ms[q])
        policy.observe(64, q, [min(accepted, q - 1)] * 64)
        qs.append(q)
        launch = max(launch + host_ms, done[-2])  # step N + 1 waits for N - 1's results
    return qs


def test_step_clock_learns_true_step_times_in_an_overlapped_schedule():
    """GPU-bound steps (q = 1: 6.7 ms, q = 16: 20 ms at 64 requests), nothing accepted, tune
    times that make speculation look free: the live times converge to the GPU's and the
    policy goes plain, probing now and then. Timed as before (the interval to the next launch
    given to the step that launched it), a lone probe read as a plain step and the next plain
    step as the probe: the times converged to nothing like the GPU's."""
    gpu = {1: 6.7, 16: 20.0}
    policy = ServerPolicy(AdaptiveConfig(probe_overhead=0.03), {64: {1: 6.0, 16: 6.0}},
                          max_q=16, probe_steps=2)
    qs = _overlapped_server(policy, gpu, 2000)
    times = policy.times()[64]
    assert times[1] == pytest.approx(6.7, rel=0.02) and times[16] == pytest.approx(20.0, rel=0.05)
    assert qs[-1000:].count(1) >= 960  # probes: 2 steps of 16 per >= 134 plain ones


@pytest.mark.parametrize("backoff, most", [(0, 0.01), (SERVER_CONFIG.probe_backoff, 0.003)])
def test_server_probes_cost_at_most_one_percent_when_nothing_passes(backoff, most):
    """The server's own policy (SERVER_CONFIG, PROBE_STEPS) at the Qwen3-8B shape's batch-1
    times (plain 5.3 ms, q = 16 6.5 ms; H200), nothing accepted: once its times are learned,
    probes add <= 1 % to the plain steps' time (3 % before: 2.45 % here), and with the
    server's backoff (probes that change nothing come up to 4x further apart) <= 0.3 %."""
    gpu = {1: 5.3, 16: 6.5}
    cfg = dataclasses.replace(SERVER_CONFIG, probe_backoff=backoff)
    policy = ServerPolicy(cfg, {64: {1: 5.0, 16: 5.0}}, max_q=16, probe_steps=PROBE_STEPS)
    tail = _overlapped_server(policy, gpu, 6000)[-4000:]
    extra = sum(gpu[q] - gpu[1] for q in tail) / sum(gpu[1] for _ in tail)
    assert 0 < extra <= most


def test_server_policy_probes_a_tune_time_soon_and_then_speculates():
    """The H100 run of 2026-12-06 (SGLang, fixture, dev prompts, 64 requests): the tune report's
    q = 16 time at 64 requests (9.39 ms, another machine) made plain look best (plain 2.61 ms
    live) although q = 16 took 3.07 ms; probes spaced by that time came 520 plain steps apart,
    and the row ran 256-506 plain steps (0.79-0.90x fixed DFLASH). Until a row's q = 16 is
    timed live it probes every `probe_every` steps: the row speculates after a few dozen."""
    gpu = {1: 2.61, 8: 2.9, 16: 3.07}

    def run(untimed: bool) -> list[int]:
        policy = ServerPolicy(SERVER_CONFIG, {64: {1: 2.67, 8: 11.61, 16: 9.39}}, max_q=16,
                              probe_steps=PROBE_STEPS)
        for _ in range(40):
            policy.observe(64, 16, [1] * 64)  # s_1 = 1, the rest 0: E(q > 1) = 2
        for _ in range(2):
            policy.timed(64, 1, gpu[1])  # plain timed live (warm-up, then the sample)
        if not untimed:
            policy.policies[64].untimed.clear()  # as before: the tune's times trusted
        return _overlapped_server(policy, gpu, 600, accepted=1)

    now, before = run(True), run(False)
    first_run = next(i for i in range(len(now)) if now[i:i + 8] == [16] * 8)
    assert first_run <= 60
    assert now[-400:].count(16) >= 390
    assert before[:500].count(1) >= 480  # the old spacing: 2 x (9.39 / 2.61 - 1) / 0.01 rounds
