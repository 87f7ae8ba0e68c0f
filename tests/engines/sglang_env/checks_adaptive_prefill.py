"""DFLASH_ASYNC_PREFILL (`engines/sglang_prefill.py`): DFLASH_ADAPTIVE's and DFLASH_TREE's
prefill without DFLASH's host sync, against SGLang 0.5.16's own DFLASH extend branch (run with
`checks_adaptive.py`: the 0.5.16 env through `test_sglang_tree.py`; skipped in the 0.5.23 env,
whose `test_sglang.py` globs `checks*.py`). That the copy waits for no GPU work is a GPU test
(`tests/engines/test_sglang_prefill.py`)."""

import inspect
import types

import pytest

from tests.engines.sglang_env import shims

shims.install()

from spiffy_plugin.engines.versions import installed  # noqa: E402

OLD_ONLY = pytest.mark.skipif(installed("sglang") > (0, 5, 16),
                              reason="the workers are written against SGLang 0.5.16")


def stand_in_worker(hidden_width=3):
    """A DFLASH worker's members that the extend step touches. MOCKS (they need CUDA and a
    model): the target worker (returns the prompt tokens' captured hidden states and the next
    tokens) and the drafter-KV append (records its arguments); the next draft input is SGLang's
    own `make_draft_input_v2`."""
    import torch
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    calls = {"target": [], "append": []}

    def target_forward(batch, capture_hidden_mode=None):
        n = int(sum(batch.extend_lens))
        hidden = torch.arange(n * hidden_width, dtype=torch.float32).view(n, hidden_width)
        calls["target"].append(capture_hidden_mode)
        return types.SimpleNamespace(
            logits_output=types.SimpleNamespace(hidden_states=hidden),
            next_token_ids=torch.tensor([7, 8, 9]), next_draft_input=None, new_seq_lens=None)

    def append(*, target_hidden, cache_loc, positions, **kw):
        calls["append"].append((target_hidden.clone(), cache_loc.clone(), positions.clone(), kw))

    worker = types.SimpleNamespace(
        _validate_phase1_sampling_support=lambda batch: None,
        target_worker=types.SimpleNamespace(forward_batch_generation=target_forward),
        model_runner=types.SimpleNamespace(
            server_args=types.SimpleNamespace(attention_backend="torch_native")),
        _append_target_hidden_to_draft_kv_by_loc=append,
        _make_next_draft_input_prefill=lambda *, bonus_tokens, seq_lens: make_draft_input_v2(
            bonus_tokens=bonus_tokens, new_seq_lens=seq_lens))
    return worker, calls


def extend_batch():
    """Three prompts: 4 new tokens after no prefix, 3 after a cached prefix of 5, 6 after 2."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, is_extend_in_batch=False, return_logprob=False,
        prefix_lens=[0, 5, 2], extend_lens=[4, 3, 6], seq_lens=torch.tensor([4, 8, 8]),
        out_cache_loc=torch.arange(13) + 100)


@OLD_ONLY
def test_prefill_writes_what_dflash_prefill_writes():
    """The same target call (hidden states captured: FULL), the same drafter-KV append (the
    prompt's hidden rows at their slots and positions), the same published lengths and next
    draft input, the hidden states dropped from the result: `prefill` against SGLang's own
    `DFlashWorkerV2.forward_batch_generation` on an extend batch."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dflash_plugin.engines.sglang_prefill import prefill

    results = []
    for run in (DFlashWorkerV2.forward_batch_generation, prefill):
        worker, calls = stand_in_worker()
        published = []
        out = run(worker, extend_batch(), on_publish=published.append)
        results.append((out, calls, published))
    (theirs, their_calls, their_pub), (ours, our_calls, our_pub) = results
    assert our_calls["target"] == their_calls["target"] == [CaptureHiddenMode.FULL]
    (h, loc, pos, kw), = our_calls["append"]
    (h2, loc2, pos2, kw2), = their_calls["append"]
    assert torch.equal(h, h2) and torch.equal(loc, loc2) and torch.equal(pos, pos2) and kw == kw2
    assert pos.tolist() == [0, 1, 2, 3, 5, 6, 7, 2, 3, 4, 5, 6, 7]
    assert pos.dtype == pos2.dtype
    assert [p.tolist() for p in our_pub] == [p.tolist() for p in their_pub] == [[4, 8, 8]]
    assert ours.logits_output.hidden_states is None and theirs.logits_output.hidden_states is None
    for field in ("bonus_tokens", "new_seq_lens", "topk_p", "topk_index"):
        a, b = getattr(ours.next_draft_input, field), getattr(theirs.next_draft_input, field)
        assert torch.equal(a, b) and a.dtype == b.dtype, field


@OLD_ONLY
def test_prefill_refuses_what_dflash_refuses():
    """Logprobs, and a target that captured no hidden states: the same errors, before any
    drafter write."""
    from dflash_plugin.engines.sglang_prefill import prefill

    worker, calls = stand_in_worker()
    batch = extend_batch()
    batch.return_logprob = True
    with pytest.raises(ValueError, match="return_logprob"):
        prefill(worker, batch)
    worker.target_worker.forward_batch_generation = lambda b, capture_hidden_mode=None: \
        types.SimpleNamespace(logits_output=types.SimpleNamespace(hidden_states=None),
                              next_token_ids=None)
    with pytest.raises(RuntimeError, match="hidden states"):
        prefill(worker, extend_batch())
    assert not calls["append"]


@OLD_ONLY
@pytest.mark.parametrize("module", ["sglang_adaptive_worker", "sglang_tree_worker"])
@pytest.mark.parametrize("on", [True, False])
def test_workers_prefill_through_it_when_on(monkeypatch, module, on):
    """The real worker classes' `forward_batch_generation` on an extend batch: `prefill` with
    DFLASH_ASYNC_PREFILL on (the default), DFLASH's own step with it off; an idle batch always
    DFLASH's. DFLASH's step is a stand-in (MOCK: it needs CUDA) that records the call."""
    import collections
    import importlib

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dflash_plugin.adaptive import LaunchLedger, StepClock

    mod = importlib.import_module(f"dflash_plugin.engines.{module}")
    seen = []
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation",
                        lambda self, batch, on_publish=None: seen.append("dflash"))
    monkeypatch.setattr(mod, "prefill", lambda w, batch, on_publish=None: seen.append("ours"))
    cls = mod.worker_class()
    worker = cls.__new__(cls)
    worker.__dict__.update(_async_prefill=on, _states={}, _clock=StepClock(), _held=None,
                           _late_seq_lens=False, _issued=collections.deque(),
                           ledger=LaunchLedger(gap_s=60))
    batch = extend_batch()
    worker.forward_batch_generation(batch)
    idle = extend_batch()
    idle.forward_mode = ForwardMode.IDLE
    worker.forward_batch_generation(idle)
    assert seen == ["ours" if on else "dflash", "dflash"]
    if module == "sglang_adaptive_worker":  # the prefill's launch is in the ledger, idle is not
        assert worker.ledger._last[1:] == ("p", len(batch.seq_lens))



@OLD_ONLY
def test_prompt_append_goes_through_its_stage_and_the_rest_stays_dflash(monkeypatch):
    """DFLASH_PREFILL_APPEND: a prefill's flat append (no 2-D slots) that fits the stage is
    written through it (dense 64-token rows, commit lengths ending at the prompt); one longer
    than the stage, and every append without a stage, go to DFLASH's own; check mode runs
    DFLASH's first, then the stage, on the drafter's KV pool. 0.5.16's source: the prefix-valid
    write of DFLASH's append, the pool's reads, the drafter layers' ids and the chunked-prefill
    size the stage is bounded by. The real class; DFLASH's append is a stand-in (MOCK: it needs
    the drafter on CUDA) that writes as the prefix-valid write does; eager stage on CPU."""
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dflash_plugin.engines import sglang_adaptive_worker as w
    from dflash_plugin.engines.sglang_prefill_append import PrefillAppend

    src = inspect.getsource(DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc)
    assert "set_kv_buffer_prefix_valid" in src and "int(cache_loc_2d.numel()) != num_tokens" in src
    for name in ("get_key_buffer", "get_value_buffer", "set_kv_buffer_prefix_valid"):
        assert callable(getattr(MHATokenToKVPool, name)), name
    assert "layer_id" in inspect.signature(RadixAttention.__init__).parameters
    assert "chunked_prefill_size" in ServerArgs.__dataclass_fields__

    kv = torch.zeros(500, 3)
    dflash = []

    def their_append(self, *, target_hidden, cache_loc, positions, cache_loc_2d=None,
                     commit_lens=None):
        dflash.append(cache_loc_2d is None)
        loc = cache_loc if cache_loc_2d is None else cache_loc_2d.reshape(-1)
        live = (torch.ones(len(loc), dtype=torch.bool) if commit_lens is None else (
            torch.arange(cache_loc_2d.shape[1])[None, :] < commit_lens[:, None]).reshape(-1))
        kv[loc[live]] = target_hidden[live] + positions[live, None]

    monkeypatch.setattr(DFlashWorkerV2, "_append_target_hidden_to_draft_kv_by_loc", their_append)
    cls = w.worker_class()
    worker = cls.__new__(cls)
    seen = []
    stage = PrefillAppend(torch.device("cpu"), lambda **kw: seen.append(kw) or their_append(
        worker, **kw), max_tokens=128, graphs=False)
    worker.__dict__.update(_q=4, _appends={}, _prompt_append=stage, _prompt_mode="1")
    n = 70
    hid, loc, pos = torch.randn(n, 3), torch.arange(n) + 200, torch.arange(n) + 5
    worker._append_target_hidden_to_draft_kv_by_loc(target_hidden=hid, cache_loc=loc,
                                                     positions=pos)
    (kw,) = seen
    assert kw["cache_loc_2d"].shape == (2, 64) and kw["commit_lens"].tolist() == [64, 6]
    assert torch.equal(kv[200:270], hid + pos[:, None]) and not kv[270:].any()
    assert dflash == [False]  # the 2-D (prefix-valid) path
    worker._append_target_hidden_to_draft_kv_by_loc(  # too long: DFLASH's flat path
        target_hidden=torch.randn(129, 3), cache_loc=torch.arange(129), positions=torch.arange(129))
    assert dflash == [False, True] and len(seen) == 1

    class Pool:  # SGLang's KV pool reads, over the stand-in's rows (one layer)
        def get_key_buffer(self, i):
            return kv

        get_value_buffer = get_key_buffer
    worker.__dict__.update(_prompt_mode="check", _draft_mr=types.SimpleNamespace(
        token_to_kv_pool=Pool()), draft_model=types.SimpleNamespace(layers=[
            types.SimpleNamespace(self_attn=types.SimpleNamespace(
                attn=types.SimpleNamespace(layer_id=0)))]))
    worker._append_target_hidden_to_draft_kv_by_loc(target_hidden=hid, cache_loc=loc,
                                                     positions=pos)
    assert dflash == [False, True, True, False] and stage.checked == 1 and stage.worst == 0.0
