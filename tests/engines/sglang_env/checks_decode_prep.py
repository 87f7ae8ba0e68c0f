"""DFLASH_FAST_DECODE_PREP (`engines/sglang_decode_prep.py`): DFLASH_ADAPTIVE's and
DFLASH_TREE's decode-step preparation against SGLang 0.5.16's own
`DFlashDraftInputV2.prepare_for_decode` (run with `checks_adaptive.py`: the 0.5.16 env through
`test_sglang_tree.py`; skipped in the 0.5.23 env, whose `test_sglang.py` globs `checks*.py`).

The allocation `alloc_for_spec_decode` is a stand-in (MOCK: the real one needs a KV allocator and
a Triton kernel); it records its arguments and raises each request's allocated length as SGLang's
does, so that steps can follow one another. Both sides call it through the same module name."""

import types

import pytest

from tests.engines.sglang_env import shims

shims.install()

from spiffy_plugin.engines.versions import installed  # noqa: E402

OLD_ONLY = pytest.mark.skipif(installed("sglang") > (0, 5, 16),
                              reason="the workers are written against SGLang 0.5.16")


def req(committed, allocated, top_k):
    return types.SimpleNamespace(kv_committed_len=committed,
                                 kv=types.SimpleNamespace(kv_allocated_len=allocated),
                                 sampling_params=types.SimpleNamespace(top_k=top_k))


def batch_of(reqs, name="DFLASH_ADAPTIVE"):
    import torch

    return types.SimpleNamespace(
        reqs=reqs, device=torch.device("cpu"), batch_size=lambda: len(reqs),
        token_to_kv_pool_allocator=types.SimpleNamespace(page_size=1), tree_cache="cache",
        req_to_token_pool="pool", req_pool_indices=torch.arange(len(reqs)) + 3,
        spec_algorithm=types.SimpleNamespace(name=name), seq_lens_cpu=None, seq_lens_sum=None)


def draft_input(bs):
    import torch
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    return make_draft_input_v2(bonus_tokens=torch.zeros(bs, dtype=torch.int64),
                               new_seq_lens=torch.ones(bs, dtype=torch.int64))


@pytest.fixture
def sglang_stand_ins(monkeypatch):
    """W from a stand-in server args, and the recording allocation (module docstring)."""
    from sglang.srt.speculative import dflash_info_v2 as dv2

    calls, w = [], {"w": 16}

    def alloc(tree_cache, req_to_token_pool, **kw):
        calls.append(dict(kw, tree_cache=tree_cache, pool=req_to_token_pool))
        for i, r in enumerate(kw["reqs"]):  # as SGLang's last loop does
            r.kv.kv_allocated_len = max(r.kv.kv_allocated_len, int(kw["nxt_kv_lens_cpu"][i]))

    monkeypatch.setattr(dv2, "alloc_for_spec_decode", alloc)
    monkeypatch.setattr(dv2, "get_server_args",
                        lambda: types.SimpleNamespace(speculative_num_draft_tokens=w["w"]))
    return calls, w


CASES = {
    "uniform": [(10, 10, 1), (3, 3, 1)],
    "reserved-already": [(5, 200, -1), (7, 7, -1)],
    "mixed-top-k": [(3, 40, 20), (90, 120, 1), (0, 0, 20)],
    "64-requests": [(i, i + 3 * i % 50, 5) for i in range(64)],
}


def run_steps(prepare, rows, steps=3, grow=4):
    """`steps` decode steps of one batch (each request's committed length grows by `grow`):
    per step what the batch and the draft input hold after `prepare` and the requests'
    allocated lengths."""
    reqs = [req(*r) for r in rows]
    out = []
    for _ in range(steps):
        batch, di = batch_of(reqs), draft_input(len(reqs))
        prepare(di, batch)
        out.append({"seq_lens_cpu": (batch.seq_lens_cpu.tolist(), batch.seq_lens_cpu.dtype),
                    "seq_lens_sum": (batch.seq_lens_sum, type(batch.seq_lens_sum)),
                    "reserved": (di.reserved_seq_lens_cpu.tolist(),
                                 di.reserved_seq_lens_cpu.dtype),
                    "reserved_sum": (di.reserved_seq_lens_sum, type(di.reserved_seq_lens_sum)),
                    "max_top_k": di.max_top_k, "uniform": di.uniform_top_k_value,
                    "allocated": [r.kv.kv_allocated_len for r in reqs]})
        for r in reqs:
            r.kv_committed_len += grow
    return out


def summary(call):
    """A recorded allocation's arguments as plain values (tensors: values, dtype, device; the
    requests: how many)."""
    import torch

    out = {}
    for k, v in call.items():
        if isinstance(v, torch.Tensor):
            out[k] = (v.tolist(), v.dtype, v.device.type)
        elif k == "reqs":
            out[k] = len(v)
        elif k != "batch":
            out[k] = v
    return out


@OLD_ONLY
@pytest.mark.parametrize("w", [16, 32])
@pytest.mark.parametrize("case", sorted(CASES))
def test_prepare_equals_dflash(sglang_stand_ins, case, w):
    """Three steps each: the same allocation arguments (lengths on the device and the host with
    their dtypes, tokens to allocate, pool indices) and the same batch and draft-input fields
    (committed lengths int64, reserved int32, their sums, top-k summary), DFLASH's method against
    ours."""
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    from dflash_plugin.engines.sglang_decode_prep import prepare_for_decode

    calls, wbox = sglang_stand_ins
    wbox["w"] = w
    theirs = run_steps(DFlashDraftInputV2.prepare_for_decode, CASES[case])
    their_calls = [summary(c) for c in calls]
    calls.clear()
    ours = run_steps(prepare_for_decode, CASES[case])
    assert ours == theirs
    assert [summary(c) for c in calls] == their_calls
    assert len(their_calls) == 3


@OLD_ONLY
def test_hook_routes_only_our_algorithms(sglang_stand_ins, monkeypatch):
    """DFLASH's own batches keep DFLASH's method; ours take `prepare_for_decode` (mode 1;
    auto: DFLASH_ADAPTIVE's only) or DFLASH's method followed by the comparison (check); an
    empty batch allocates nothing."""
    from dflash_plugin.engines import sglang_decode_prep as dp

    seen = []
    monkeypatch.setattr(dp, "prepare_for_decode", lambda di, b: seen.append("ours"))

    def original(di, b):
        seen.append("dflash")
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
        DFlashDraftInputV2.prepare_for_decode(di, b)

    rows = [req(10, 10, 1), req(3, 3, 1)]
    monkeypatch.setitem(dp._SETTLED, "mode", "1")
    dp.around_prepare(original, draft_input(2), batch_of(rows, name="DFLASH"))
    dp.around_prepare(original, draft_input(2), batch_of(rows, name="DFLASH_TREE"))
    monkeypatch.setitem(dp._SETTLED, "mode", "check")
    dp.around_prepare(original, draft_input(2), batch_of(rows, name="DFLASH_ADAPTIVE"))
    assert seen == ["dflash", "ours", "dflash"]
    monkeypatch.setitem(dp._SETTLED, "mode", "auto")
    dp.around_prepare(original, draft_input(2), batch_of(rows, name="DFLASH_TREE"))
    dp.around_prepare(original, draft_input(2), batch_of(rows, name="DFLASH_ADAPTIVE"))
    assert seen[3:] == ["dflash", "ours"]
    calls, _ = sglang_stand_ins
    n = len(calls)
    dp.around_prepare(original, draft_input(0), batch_of([], name="DFLASH_ADAPTIVE"))
    assert len(calls) == n


@OLD_ONLY
def test_check_raises_on_a_difference(sglang_stand_ins):
    """A DFLASH method that reserves one slot more than the plan: check mode raises, naming the
    fields."""
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    from dflash_plugin.engines import sglang_decode_prep as dp

    def off_by_one(di, b):
        DFlashDraftInputV2.prepare_for_decode(di, b)
        di.reserved_seq_lens_cpu = di.reserved_seq_lens_cpu + 1

    with pytest.raises(RuntimeError, match="DFLASH_FAST_DECODE_PREP=check.*'reserved'"):
        dp.check(off_by_one, draft_input(2), batch_of([req(10, 10, 1), req(3, 3, 1)]))


@OLD_ONLY
def test_the_hook_is_installed_only_when_on(monkeypatch):
    """At 0 DFLASH's method runs untouched; at 1 the AROUND hook is on it once; unset (auto)
    it is on too."""
    from dflash_plugin.engines import sglang_decode_prep as dp
    from tests.engines.sglang_env.hooks import assert_installed_only_when_on

    assert_installed_only_when_on(monkeypatch, dp, dp.around_prepare,
                                  "DFLASH_FAST_DECODE_PREP", "1")
    monkeypatch.delenv("DFLASH_FAST_DECODE_PREP")
    assert dp.register_hook() and dp._SETTLED["mode"] == "auto"
