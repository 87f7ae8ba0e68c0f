"""DFLASH_BATCH_ADMISSION (`engines/sglang_admission.py`) against SGLang 0.5.16's scheduler types
(run with `checks_adaptive.py`: the 0.5.16 env through `test_sglang_tree.py`; skipped in the
0.5.23 env, whose `test_sglang.py` globs `checks*.py`). The scheduler is a stand-in (MOCK: a
real one needs a GPU worker) with the members the hook reads; the hooked method's signature and
the plan type are SGLang's own."""

import inspect
import types

import pytest

from tests.engines.sglang_env import shims

shims.install()

from spiffy_plugin.engines.versions import installed  # noqa: E402

OLD_ONLY = pytest.mark.skipif(installed("sglang") > (0, 5, 16),
                              reason="the workers are written against SGLang 0.5.16")


@OLD_ONLY
def test_the_hooked_method_is_sglangs():
    """`Scheduler.get_new_batch_prefill(self, running_batch)` returns a `NextBatchPlan` of
    (batch_to_run, running_batch), and holds for DFLASH at full load through
    `resolve_min_free_slots` with the formula the hook's `auto` copies."""
    from sglang.srt.managers.min_free_slots_delayer import resolve_min_free_slots
    from sglang.srt.managers.schedule_batch import NextBatchPlan
    from sglang.srt.managers.scheduler import Scheduler

    from dflash_plugin.engines.sglang_admission import sglang_size

    assert list(inspect.signature(Scheduler.get_new_batch_prefill).parameters) == [
        "self", "running_batch"]
    assert list(NextBatchPlan.__struct_fields__) == ["batch_to_run", "running_batch"]
    for n in (8, 12, 13, 18, 19, 64, 256):
        assert resolve_min_free_slots(None, n, is_dflash_family=True) == sglang_size(n)
    # the members the hook reads (the stand-in scheduler below has them): SGLang's pass reads
    # the same ones
    raw = inspect.getsource(Scheduler._get_new_batch_prefill_raw)
    for member in ("self.waiting_queue", "self.chunked_req", "self.get_num_allocatable_reqs(",
                   "running_batch.batch_is_full"):
        assert member in raw, member
    assert "self.max_running_requests" in inspect.getsource(Scheduler)
    assert "self.draft_worker = DraftWorkerClass(" in inspect.getsource(Scheduler)  # `cost`
    assert callable(Scheduler.get_num_allocatable_reqs)


def scheduler(name, waiting, running_bs=32, max_running=64, chunked=None, ledger=None):
    batch = types.SimpleNamespace(batch_size=lambda: running_bs, is_prefill_only=False)
    s = types.SimpleNamespace(
        spec_algorithm=types.SimpleNamespace(name=name), waiting_queue=[object()] * waiting,
        max_running_requests=max_running, chunked_req=chunked,
        get_num_allocatable_reqs=lambda bs: max_running - bs,
        draft_worker=types.SimpleNamespace(ledger=ledger))
    return s, batch


@OLD_ONLY
@pytest.mark.parametrize("size", [4, "auto"])
def test_hook_holds_then_admits(monkeypatch, size):
    """Our algorithm's scheduler: with 1-3 requests waiting the pass is held (SGLang's pass not
    called, an empty plan with the running batch back), at most 4 times in a row; SGLang's pass
    then admits and the count starts again. 4 waiting: admitted at once."""
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    from dflash_plugin.engines import sglang_admission as sa

    monkeypatch.setitem(sa._SETTLED, "size", size)
    calls = []

    def original(sched, running_batch):
        calls.append(len(sched.waiting_queue))
        return NextBatchPlan(batch_to_run="prefill", running_batch=running_batch)

    sched, batch = scheduler("DFLASH_ADAPTIVE", waiting=1)
    plans = [sa.around_get_new_batch_prefill(original, sched, batch) for _ in range(4)]
    assert all(p.batch_to_run is None and p.running_batch is batch for p in plans)
    assert not calls and getattr(sched, sa.HELD) == 4
    assert sa.around_get_new_batch_prefill(original, sched, batch).batch_to_run == "prefill"
    assert calls == [1] and getattr(sched, sa.HELD) == 0
    sched.waiting_queue = [object()] * 4
    assert sa.around_get_new_batch_prefill(original, sched, batch).batch_to_run == "prefill"
    assert calls == [1, 4]


@OLD_ONLY
def test_hook_leaves_others_alone(monkeypatch):
    """SGLang's own DFLASH, an idle server, a chunked prefill under way and too few free slots:
    SGLang's pass every time."""
    from dflash_plugin.engines import sglang_admission as sa

    monkeypatch.setitem(sa._SETTLED, "size", 4)
    calls = []

    def original(sched, running_batch):
        calls.append(sched)
        return types.SimpleNamespace(batch_to_run=None, running_batch=running_batch)

    cases = [scheduler("DFLASH", waiting=1), scheduler("DFLASH_TREE", waiting=1, running_bs=0),
             scheduler("DFLASH_TREE", waiting=1, chunked=object()),
             scheduler("DFLASH_ADAPTIVE", waiting=1, running_bs=63)]
    for sched, batch in cases:
        sa.around_get_new_batch_prefill(original, sched, batch)
    assert calls == [s for s, _ in cases]


@OLD_ONLY
def test_the_hook_is_installed_unless_off(monkeypatch):
    """Not at 0; once at auto; by default (unset: cost) too."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from dflash_plugin.engines import sglang_admission as sa
    from tests.engines.sglang_env.hooks import assert_installed_only_when_on

    assert_installed_only_when_on(monkeypatch, sa, sa.around_get_new_batch_prefill,
                                  "DFLASH_BATCH_ADMISSION", "auto")
    HookRegistry._hooks.clear()
    monkeypatch.delenv("DFLASH_BATCH_ADMISSION")
    assert sa.register_hook() and sa._SETTLED["size"] == "cost"
    assert [h for _, h, _ in HookRegistry._hooks[sa.TARGET]] == [sa.around_get_new_batch_prefill]


@OLD_ONLY
def test_cost_holds_by_the_workers_ledger(monkeypatch):
    """`cost`: the hold size from the adaptive worker's ledger (a real `LaunchLedger`: 2.5-ms
    steps, a 6-ms pass of 2 after every other step) for the requests in flight: 7 or 8 at 32
    (one fewer waiting is held, that many admitted); 1 (never held) from a ledger that has
    measured nothing yet and without a ledger (light loads: `tests/dflash/test_admission.py`)."""
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    from dflash_plugin.adaptive import LaunchLedger
    from dflash_plugin.admission import hold_size_from_ledger
    from dflash_plugin.engines import sglang_admission as sa

    led, t = LaunchLedger(gap_s=1.0, decay=0.9), 0.0
    for i in range(400):
        led.launch(t, "d", 32)
        if i % 2:
            led.launch(t + 0.0035, "p", 2)
            t += 0.0085
        else:
            t += 0.0025
    k = hold_size_from_ledger(led, 32)
    assert k in (7, 8)
    monkeypatch.setitem(sa._SETTLED, "size", "cost")

    def original(sched, running_batch):
        return NextBatchPlan(batch_to_run="prefill", running_batch=running_batch)

    held = sa.around_get_new_batch_prefill(original, *scheduler(
        "DFLASH_ADAPTIVE", waiting=k - 1, running_bs=33 - k, ledger=led))
    assert held.batch_to_run is None
    for sched, batch in (scheduler("DFLASH_ADAPTIVE", waiting=k, running_bs=32 - k, ledger=led),
                         scheduler("DFLASH_ADAPTIVE", waiting=1, ledger=LaunchLedger()),
                         scheduler("DFLASH_ADAPTIVE", waiting=1, running_bs=31)):
        assert sa.around_get_new_batch_prefill(original, sched, batch).batch_to_run == "prefill"
