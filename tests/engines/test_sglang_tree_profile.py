"""DFLASH_TREE's per-phase round profile (`sglang_tree_profile`), on CPU (host-clock events
stand in for CUDA events there; a fake clock, advanced by the test, stands in for the host's):
off by default (no events), one line per N rounds with each phase's mean, a clear error for a
bad `DFLASH_TREE_PROFILE`."""

import time

import pytest
import torch

from dflash_plugin.engines.sglang_tree_profile import ENV, PHASES, RoundProfile, profile_every
from dflash_plugin.errors import ConfigError

CPU = torch.device("cpu")


@pytest.mark.parametrize("raw,every", [(None, 0), ("", 0), ("0", 0), ("1", 1), (" 50 ", 50)])
def test_profile_every_reads_the_environment(raw, every):
    assert profile_every({} if raw is None else {ENV: raw}) == every


@pytest.mark.parametrize("raw", ["-1", "x", "2.5", "1e3"])
def test_profile_every_refuses_bad_values(raw):
    with pytest.raises(ConfigError, match=f"{ENV}: must be an integer >= 0.*{raw!r}"):
        profile_every({ENV: raw})


def test_off_records_nothing():
    lines = []
    prof = RoundProfile(0, CPU, log=lambda *a: lines.append(a))
    for _ in range(5):
        ev = prof.start()
        assert ev is None
        for i in range(len(PHASES)):
            prof.mark(ev, i)
        prof.end(ev, 1)
    assert lines == [] and prof.lines == [] and prof.pending == []


class Clock:  # time.perf_counter of the profile and of the host events, moved by `sleep`
    def __init__(self, monkeypatch):
        self.t = 100.0
        monkeypatch.setattr(time, "perf_counter", lambda: self.t)

    def sleep(self, s: float) -> None:
        self.t += s


def test_one_line_per_n_rounds_with_phase_means(monkeypatch):
    clock = Clock(monkeypatch)
    lines = []
    prof = RoundProfile(2, CPU, log=lambda *a: lines.append(a))
    sleeps = [[0.002, 0.0, 0.006, 0.0], [0.004, 0.0, 0.002, 0.0], [0.001, 0.0, 0.0, 0.0]]
    for round_sleeps in sleeps:
        ev = prof.start()
        for i, s in enumerate(round_sleeps):
            clock.sleep(s)
            prof.mark(ev, i)
        prof.end(ev, 3)
    assert len(lines) == 1 and len(prof.pending) == 1  # the third round waits for a fourth
    means = prof.lines[0]
    assert list(means) == [*PHASES, "between", *(f"host_{p}" for p in PHASES)]
    assert means["host_draft"] == pytest.approx(3.0)  # host clock: the same sleeps
    assert means["host_verify"] == pytest.approx(4.0) and means["host_tree"] == 0
    assert means["between"] == 0  # one gap (round 1 end -> round 2 start), no sleep
    assert means["draft"] == pytest.approx(3.0)  # ms: (2 + 4) / 2
    assert means["verify"] == pytest.approx(4.0)  # (6 + 2) / 2
    assert means["tree"] == 0 and means["append"] == 0
    fmt, n, batch = lines[0][:3]
    assert "DFLASH_TREE round profile" in fmt and (n, batch) == (2, 3)
    assert prof.flush(3)["draft"] == pytest.approx(1.0)  # the pending third round
    assert prof.flush(3) == {} and len(lines) == 2
    assert prof.host == [] and prof.pending == []


def test_between_is_the_time_from_one_rounds_end_to_the_next_start(monkeypatch):
    clock = Clock(monkeypatch)
    prof = RoundProfile(3, CPU, log=lambda *a: None)
    for wait in (0.0, 0.005, 0.003):  # the host's work between rounds
        clock.sleep(wait)
        ev = prof.start()
        for i in range(len(PHASES)):
            prof.mark(ev, i)
        prof.end(ev, 1)
    assert prof.lines[0]["between"] == pytest.approx(4.0)  # ms: (5 + 3) / 2
