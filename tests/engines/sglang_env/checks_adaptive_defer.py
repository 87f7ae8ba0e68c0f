"""DFLASH_ADAPTIVE's held plain-step appends (`DFLASH_ADAPTIVE_DEFER_APPEND`,
`engines/sglang_adaptive_defer.py`) inside the worker class of SGLang 0.5.16 (run with
`checks_adaptive.py`: the 0.5.16 env through `test_sglang_tree.py`; skipped in the 0.5.23 env,
whose `test_sglang.py` globs `checks*.py`)."""

import pytest

from tests.engines.sglang_env import shims

shims.install()

from spiffy_plugin.engines.versions import installed  # noqa: E402

OLD_ONLY = pytest.mark.skipif(installed("sglang") > (0, 5, 16),
                              reason="the worker is written against SGLang 0.5.16")


@OLD_ONLY
def test_held_plain_appends_reach_the_drafter_before_it_reads(monkeypatch):
    """DFLASH_ADAPTIVE_DEFER_APPEND: q = 1 steps' drafter-context rows are held and written in
    one DFLASH append before a q > 1 step (whose drafter reads them), before a prefill, when the
    batch's requests change (a finished request's slot reused by another) and when the buffer
    is full. Against the same schedule with every step appending at once: the drafter's KV (a
    dict slot -> row here) is the same whenever the drafter reads it and at the end, in fewer
    append calls. The real worker class and its real `forward_batch_generation`; DFLASH's own
    step and append are replaced by stand-ins (MOCKS: they need CUDA), which write and read a
    dict the way DFLASH's write and read the drafter's KV pool."""
    import collections
    import types

    import torch
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dflash_plugin.adaptive import LaunchLedger, StepClock
    from dflash_plugin.engines import sglang_adaptive_worker as w
    from dflash_plugin.engines.sglang_adaptive_defer import DeferredAppend

    def mock_append(self, *, target_hidden, cache_loc, positions, cache_loc_2d=None,
                    commit_lens=None):
        self.calls += 1
        slots = cache_loc.reshape(-1).tolist()
        assert len(set(slots)) == len(slots), "one write, one slot twice: undefined on a GPU"
        for row, slot, p in zip(target_hidden.tolist(), cache_loc.reshape(-1).tolist(),
                                positions.reshape(-1).tolist()):
            self.kv[slot] = (tuple(row), p)

    def mock_step(self, batch, on_publish=None):
        if batch.forward_mode.is_extend():  # a prefill writes its prompt's slots at once
            self.seen.append(("prefill", dict(self.kv)))
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=batch.hidden, cache_loc=batch.slots, positions=batch.slots)
            return None
        if self._q > 1:
            self.seen.append(("draft", dict(self.kv)))  # the drafter reads its context
        bs = len(batch.seq_lens)
        loc = batch.slots.view(bs, 1) * 100 ** (self._q > 1) + torch.arange(self._q)  # [bs, q]
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=batch.hidden.repeat_interleave(self._q, 0), cache_loc=loc.view(-1),
            positions=loc.view(-1), cache_loc_2d=loc,
            commit_lens=torch.ones(bs, dtype=torch.int32))
        return None

    monkeypatch.setattr(DFlashWorkerV2, "_append_target_hidden_to_draft_kv_by_loc", mock_append)
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", mock_step)

    class Mode:
        def __init__(self, extend):
            self.extend = extend

        def is_extend(self):
            return self.extend

        def is_idle(self):
            return False

    reqs = {name: object() for name in "ABC"}

    def batch(names, slots, extend=False, tag=0.0):
        hidden = torch.tensor([[float(s), tag] for s in slots])  # [bs, 2] distinct rows
        return types.SimpleNamespace(forward_mode=Mode(extend), is_extend_in_batch=False,
                                     seq_lens=list(slots), reqs=[reqs[n] for n in names],
                                     slots=torch.tensor(slots), hidden=hidden)

    # (batch, q): prefill A, B; plain steps; a probe; B leaves and A's next token reuses B's
    # slot 33, held a step before; C's prefill reuses B's slot 13; a long plain stretch
    # overflows the buffer (4)
    schedule = [(batch("AB", [10, 11], extend=True), None)]
    schedule += [(batch("AB", [12 + 2 * i, 13 + 2 * i], tag=i), 1) for i in range(3)]
    schedule += [(batch("AB", [30, 31], tag=9), 16), (batch("AB", [32, 33], tag=8), 1)]
    schedule += [(batch("A", [33], tag=7), 1), (batch("C", [13], extend=True), None)]
    schedule += [(batch("AC", [40 + 2 * i, 41 + 2 * i], tag=i), 1) for i in range(5)]
    schedule += [(batch("AC", [60, 61], tag=5), 16)]

    def serve(held):
        cls = w.worker_class()
        worker = cls.__new__(cls)
        qs = iter(q for _, q in schedule if q)
        worker.__dict__.update(
            _q=16, _states={1: {}, 16: {}}, _held=DeferredAppend(held) if held else None,
            _held_reqs=(), _appends={}, _async_prefill=False,  # DFLASH's step (mocked)
            _clock=StepClock(), ledger=LaunchLedger(), _issued=collections.deque(),
            _steps=collections.Counter(), _log_every=0, _no_noise=False, kv={}, calls=0,
            seen=[], policy=types.SimpleNamespace(choose=lambda bs: next(qs),
                                                  timed=lambda *a: None),
            _target_worker=types.SimpleNamespace(
                model_runner=types.SimpleNamespace(model=object())))
        worker._use = lambda q: setattr(worker, "_q", q)
        for b, _ in schedule:
            worker.forward_batch_generation(b)
        worker._write_held()
        return worker

    now, late = serve(0), serve(4)
    assert [k for k, _ in late.seen] == ["prefill", "draft", "prefill", "draft"]
    assert late.seen == now.seen  # the drafter reads the same context every time
    assert late.kv == now.kv and late.kv[33][0] == (33.0, 7.0)  # A's row over B's
    assert late.calls < now.calls
