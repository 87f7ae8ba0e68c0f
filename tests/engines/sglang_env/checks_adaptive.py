"""DFLASH_ADAPTIVE against real SGLang (run with `checks_tree.py`: the 0.5.23 env through
`test_sglang.py`, the 0.5.16 env through `test_sglang_tree.py`).

Registration, SGLang's conformance check of the spec class, launch-time validation through
SGLang's own `prepare_server_args` on CPU, and the worker against SGLang 0.5.16's real source
(static conformance: every attribute a runtime state swaps is one `DFlashWorkerV2` / the model
runner sets, every SGLang callable exists with the parameters the worker passes, DFLASH's step
reads the draft the way the q = 1 state feeds it). The worker itself needs CUDA: it runs on the
GPU machine (`benchmarks/gpu_adaptive_sglang.py`).
"""

import inspect
import json

import pytest

from tests.engines.sglang_env import shims

shims.install()

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.speculative.spec_registry import get_spec  # noqa: E402

from dflash_plugin.engines import sglang_adaptive as algo  # noqa: E402
from dflash_plugin.engines.sglang import register  # noqa: E402
from dflash_plugin.errors import ConfigError  # noqa: E402
from spiffy_plugin.engines.versions import installed  # noqa: E402
from tests.engines.sglang_env.fixtures import FIX  # noqa: E402

OLD = installed("sglang") <= (0, 5, 16)
OLD_ONLY = pytest.mark.skipif(not OLD, reason="the worker is written against SGLang 0.5.16")
TARGET, DRAFT = FIX / "code-target", FIX / "code-target-dflash-b16"


def tune_doc(engine="sglang"):
    """A `dflash tune` report: plain faster at 8 requests, k = 15 at 1."""
    cells = [dict(k=0, concurrency=1, tokens_per_s=800.0, tau=None),
             dict(k=15, concurrency=1, tokens_per_s=1600.0, tau=5.0),
             dict(k=0, concurrency=8, tokens_per_s=6900.0, tau=None),
             dict(k=15, concurrency=8, tokens_per_s=5500.0, tau=5.0)]
    return {"kind": "dflash-tune", "engine": engine, "cells": cells}


@pytest.fixture
def tune_json(tmp_path):
    p = tmp_path / "tune.json"
    p.write_text(json.dumps(tune_doc()))
    return p


def test_registration_is_idempotent():
    register()
    register()
    spec = SpeculativeAlgorithm.from_string("dflash_adaptive")
    assert spec is get_spec("DFLASH_ADAPTIVE") and type(spec).__name__ == "DFlashAdaptiveAlgo"
    assert spec.supports_overlap and spec.validate_server_args is algo.validate_server_args
    assert algo.register() is False
    assert get_spec("DFLASH_TREE") is not None  # both registered by the one entry point


def test_spec_class_conforms():
    from sglang.srt.speculative.spec_registry import _assert_custom_spec_algo_conforms

    cls = algo.spec_class()
    _assert_custom_spec_algo_conforms(cls)
    spec = get_spec("DFLASH_ADAPTIVE") or cls("DFLASH_ADAPTIVE", lambda sa: None)
    assert spec.is_dflash_family() and not spec.is_dflash() and not spec.is_eagle()
    # each runtime state's runners are sized for its own q, the drafter's included
    for q in (1, 8, 16):
        assert spec.get_num_tokens_per_req_for_target_verify(q, False) == q
        assert spec.get_num_tokens_per_req_for_target_verify(q, True) == q


def _server_args(*extra):
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", str(TARGET), "--speculative-algorithm",
                              "DFLASH_ADAPTIVE", "--speculative-draft-model-path", str(DRAFT),
                              "--device", "cpu", *extra])
    if hasattr(sa, "resolve_once"):
        sa.resolve_once()
    return sa


LAST = ("device: DFLASH_ADAPTIVE needs a CUDA device" if OLD else
        "sglang: DFLASH_ADAPTIVE's worker is written against SGLang 0.5.16")


@pytest.mark.parametrize("extra,message", [
    ([], "speculative_adaptive_config: required for DFLASH_ADAPTIVE"),
    (["--speculative-adaptive-config", "/nonexistent.json"],
     "speculative_adaptive_config: no such file"),
    (["CONFIG", "--speculative-num-draft-tokens", "17"],
     r"speculative_num_draft_tokens: must be in \[2, 16\]"),
    (["CONFIG", "--speculative-eagle-topk", "4"],
     "speculative_eagle_topk: DFLASH_ADAPTIVE drafts one path"),
    (["CONFIG"], LAST),
])
def test_launch_validation_errors(extra, message, tune_json):
    register()
    extra = [a for x in extra for a in (["--speculative-adaptive-config", str(tune_json)]
                                        if x == "CONFIG" else [x])]
    with pytest.raises(ConfigError, match=message):
        _server_args(*extra)


def test_launch_validation_reads_the_tune_report(tmp_path):
    register()
    vllm = tmp_path / "vllm.json"
    vllm.write_text(json.dumps(tune_doc("vllm")))
    with pytest.raises(ConfigError, match="must be measured in SGLang"):
        _server_args("--speculative-adaptive-config", str(vllm))
    junk = tmp_path / "junk.json"
    junk.write_text("{")
    with pytest.raises(ConfigError, match="is not JSON"):
        _server_args("--speculative-adaptive-config", str(junk))


@pytest.mark.parametrize("env,value,message", [
    ("DFLASH_ADAPTIVE_PLAIN_ATTENTION", "yes", "DFLASH_ADAPTIVE_PLAIN_ATTENTION: must be 0 or 1"),
    ("DFLASH_ADAPTIVE_DEFER_APPEND", "-1", "DFLASH_ADAPTIVE_DEFER_APPEND must be >= 0"),
])
def test_launch_validation_checks_the_workers_environment(monkeypatch, tune_json, env, value,
                                                          message):
    register()
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=message):  # ConfigError is a ValueError
        _server_args("--speculative-adaptive-config", str(tune_json))


# --- the worker against SGLang 0.5.16's source ----------------------------------------------

@OLD_ONLY
def test_worker_subclasses_dflash_and_swaps_only_what_dflash_sets():
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dflash_plugin.engines import sglang_adaptive_worker as w

    cls = w.worker_class()
    assert issubclass(cls, DFlashWorkerV2) and w.worker_factory(None) is cls
    init = inspect.getsource(DFlashWorkerV2.__init__)
    for a in w.STATE_ATTRS:  # each swapped attribute is one DFLASH's __init__ sets
        assert f"self.{a} =" in init or f"self.{a}: " in init, a
    fresh = w.fresh_attrs(3, None, None)
    assert set(fresh) | {"draft_model_runner"} == set(w.STATE_ATTRS)
    assert list(inspect.signature(DFlashWorkerV2.__init__).parameters) == [
        "self", "server_args", "gpu_id", "ps", "nccl_port", "target_worker"]


@OLD_ONLY
def test_what_the_states_are_built_with():
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative import draft_worker_common as dwc
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    params = inspect.signature(DecodeCudaGraphRunner.__init__).parameters
    assert {"attn_backend", "speculative_num_draft_tokens"} <= set(params)
    src = inspect.getsource(ModelRunner)
    for attr in ("self.attn_backend", "self.decode_cuda_graph_runner",
                 "self.capture_tail_hooks", "init_new_workspace"):
        assert attr in src, attr
    assert "init_new_workspace" in inspect.signature(ModelRunner._get_attention_backend).parameters
    assert list(inspect.signature(dwc.build_block_pos_offsets).parameters) == ["length", "device"]
    assert "draft_token_num" in inspect.signature(dwc.make_draft_block_spec_info).parameters
    assert list(inspect.signature(BaseSpecWorker.on_verify_complete_cpu).parameters) == [
        "self", "num_correct_drafts_per_req", "batch_size"]
    assert list(inspect.signature(_handle_dflash).parameters) == ["server_args"]


@OLD_ONLY
def test_dflash_step_reads_the_draft_as_the_plain_state_feeds_it():
    """q = 1: DFLASH's step takes the draft from `_draft_sampler.out` when the drafter's
    forward says it ran a graph; `NoDraft` / `EmptyDraft` answer exactly that."""
    import torch
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dflash_plugin.engines.sglang_adaptive_worker import EmptyDraft, NoDraft

    src = inspect.getsource(DFlashWorkerV2.forward_batch_generation)
    assert "self.draft_model_runner.forward(forward_batch)" in src
    assert "if self._draft_sampler is not None and draft_out.can_run_graph:" in src
    assert "self._draft_sampler.out[" in src
    assert "speculative_num_draft_tokens=int(self.block_size)" in src
    out = NoDraft(object()).forward(None)
    assert out.can_run_graph and out.logits_output is None
    bs, q = 3, 1
    draft_next = EmptyDraft("cpu").out[: bs * (q - 1)].view(bs, q - 1)
    assert draft_next.shape == (3, 0)
    block = torch.zeros(bs, q, dtype=torch.int64)
    block[:, 1:].copy_(draft_next)  # what DFLASH does with it


@OLD_ONLY
def test_switching_states_swaps_worker_and_runner_attributes():
    """`_use(q)`: the worker's block attributes and both runners' backends / graphs come from
    q's state; buffers a state grew are kept for its next turn; q = 1 drafts nothing and
    leaves the drafter's backend as it was. Stand-in runners (attributes only), the real class."""
    import collections
    from types import SimpleNamespace

    from dflash_plugin.adaptive import AdaptiveConfig, ServerPolicy
    from dflash_plugin.engines import sglang_adaptive_worker as w

    cls = w.worker_class()
    worker = cls.__new__(cls)  # no SGLang start-up: only what _use and the read-back touch
    target = SimpleNamespace(attn_backend="target-16", decode_cuda_graph_runner="tgraph-16")
    draft = SimpleNamespace(attn_backend="draft-16", decode_cuda_graph_runner="dgraph-16")
    worker.__dict__.update(_target_worker=SimpleNamespace(model_runner=target), _draft_mr=draft,
                           draft_model_runner=draft, _q=16)
    worker.__dict__.update(w.fresh_attrs(16, "offsets-16", "spec-16"))
    worker._draft_block_ids_buf = "ids-16"
    worker._states = {16: worker._snapshot()}
    one = w.fresh_attrs(1, "offsets-1", "spec-1")
    one.update(draft_model_runner=w.NoDraft(draft), _draft_sampler=w.EmptyDraft("cpu"),
               target={"attn_backend": "target-1", "decode_cuda_graph_runner": "tgraph-1"},
               draft={"attn_backend": "draft-16", "decode_cuda_graph_runner": "dgraph-16"})
    worker._states[1] = one

    worker._use(1)
    assert (worker.block_size, worker.speculative_num_draft_tokens) == (1, 1)
    assert (target.attn_backend, target.decode_cuda_graph_runner) == ("target-1", "tgraph-1")
    assert draft.attn_backend == "draft-16" and isinstance(worker.draft_model_runner, w.NoDraft)
    assert worker.draft_model_runner.attn_backend == "draft-16"  # the real runner's, delegated
    assert worker._draft_block_ids_buf is None
    worker._draft_block_ids_buf = "ids-1"  # grown during q = 1's step
    worker._use(16)
    assert worker._draft_block_ids_buf == "ids-16" and worker.draft_model_runner is draft
    assert (target.attn_backend, worker._block_pos_offsets) == ("target-16", "offsets-16")
    worker._use(1)
    assert worker._draft_block_ids_buf == "ids-1"

    # read-back: accepted counts go to the step they belong to, in issue order
    rows = {1: {1: 1.0, 16: 2.0}}
    worker.policy = ServerPolicy(AdaptiveConfig(), rows, 16)
    worker._issued = collections.deque([(1, 16), (1, 1)])
    seen = []
    worker.policy.observe = lambda bs, q, acc: seen.append((bs, q, acc))
    worker.on_verify_complete_cpu([3], batch_size=1)
    worker.on_verify_complete_cpu([0], batch_size=1)
    worker.on_verify_complete_cpu([5], batch_size=1)  # nothing issued: ignored
    assert seen == [(1, 16, [3]), (1, 1, [0])]


def test_memory_note_reads_the_allocator(monkeypatch):
    """The periodic DFLASH_ADAPTIVE line's memory part: allocator retries, reserved and free
    memory (a stand-in `torch.cuda` on this CPU machine), and what it says without a GPU."""
    from dflash_plugin.engines import sglang_adaptive_worker as w

    monkeypatch.setattr(w.torch.cuda, "is_available", lambda: False)
    assert w.memory_note() == "memory: no CUDA device"
    monkeypatch.setattr(w.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(w.torch.cuda, "memory_stats", lambda: {
        "num_alloc_retries": 3, "reserved_bytes.all.current": 3 * 2**29})
    monkeypatch.setattr(w.torch.cuda, "mem_get_info", lambda: (2**30, 80 * 2**30))
    assert w.memory_note() == ("memory: allocator retries 3, reserved 1.50 GiB, free 1.00 of "
                               "80.0 GiB")


@OLD_ONLY
def test_decode_append_goes_through_q_graphs_and_the_rest_stays_dflash():
    """DFLASH's decode step hands its append dense `[bs, q]` slots and commit lengths (checked
    in 0.5.16's source); the worker replays q's `AppendStage` with them (bucket rows, padded
    rows committing nothing); a prefill's append (no 2-D slots) and a width other than the
    state's q go to DFLASH's own. Eager stage on CPU (graphs need CUDA), the real class."""
    import torch
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dflash_plugin.engines import sglang_adaptive_worker as w
    from dflash_plugin.engines.sglang_tree_append import AppendStage

    src = inspect.getsource(DFlashWorkerV2.forward_batch_generation)
    assert "cache_loc_2d=verify_out_cache_loc_2d," in src and "commit_lens=commit_lens," in src
    params = inspect.signature(DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc).parameters
    assert [p for p in params if p != "self"] == [
        "target_hidden", "cache_loc", "positions", "cache_loc_2d", "commit_lens"]

    calls = []
    cls = w.worker_class()
    worker = cls.__new__(cls)
    worker.__dict__.update(_q=4, _appends={4: AppendStage(torch.device("cpu"),
                                                          lambda **kw: calls.append(kw),
                                                          graphs=False)})
    bs, q, h = 3, 4, 6
    hid = torch.arange(bs * q * h, dtype=torch.float32).view(bs * q, h)
    loc = torch.arange(100, 100 + bs * q).view(bs, q)
    pos = torch.arange(bs * q, dtype=torch.int64)
    commit = torch.tensor([1, 4, 2], dtype=torch.int32)
    worker._append_target_hidden_to_draft_kv_by_loc(
        target_hidden=hid, cache_loc=loc.reshape(-1), positions=pos, cache_loc_2d=loc,
        commit_lens=commit)
    (kw,) = calls  # bucket 4: one padded row
    assert kw["cache_loc_2d"].shape == (4, q) and kw["target_hidden"].shape == (4 * q, h)
    assert torch.equal(kw["target_hidden"][: bs * q], hid)
    assert torch.equal(kw["cache_loc_2d"][:bs], loc)
    assert torch.equal(kw["positions"][: bs * q], pos)
    assert kw["commit_lens"].tolist() == [1, 4, 2, 0]  # the padded row writes nothing

    empty = torch.empty(0, h)
    none = torch.empty(0, dtype=torch.int64)
    # DFLASH's own (returns at once for 0 tokens): a prefill's call, then a 2-wide block
    worker._append_target_hidden_to_draft_kv_by_loc(target_hidden=empty, cache_loc=none,
                                                     positions=none)
    worker._append_target_hidden_to_draft_kv_by_loc(
        target_hidden=empty, cache_loc=none, positions=none,
        cache_loc_2d=none.view(0, 2), commit_lens=torch.empty(0, dtype=torch.int32))
    assert len(calls) == 1


@OLD_ONLY
def test_plain_step_skips_only_the_drafter_blocks_noise_embedding(monkeypatch):
    """q = 1: DFLASH's step embeds its block ids (its `_draft_block_ids_buf`) through the
    target's `get_input_embeddings()` only for the drafter's forward (checked in 0.5.16's
    source); inside a q = 1 step that returns an uninitialised tensor of the right shape for
    those ids and the real table's rows for any other ids; q > 1 steps and the model after a
    step (one that raised included) are untouched. The real class and a real torch embedding;
    DFLASH's CUDA step is replaced by a stand-in that embeds as it does."""
    import collections
    import re
    from types import SimpleNamespace

    import torch
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dflash_plugin.adaptive import AdaptiveConfig, LaunchLedger, ServerPolicy, StepClock
    from dflash_plugin.engines import sglang_adaptive_worker as w

    src = inspect.getsource(DFlashWorkerV2.forward_batch_generation)
    assert "target_model = self.target_worker.model_runner.model" in src
    assert "embed_module = target_model.get_input_embeddings()" in src
    assert "block_ids = self._draft_block_ids_buf[:bs]" in src
    assert "noise_embedding = embed_module(block_ids)" in src
    uses = re.findall(r"\b(noise_embedding|input_embeds)\b", src)
    assert uses.count("input_embeds") == 3  # assigned, then only the drafter's ForwardBatch
    assert "input_embeds=input_embeds," in src.split("draft_model_runner.forward")[0]

    class Target(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)

        def get_input_embeddings(self):
            return self.embed

    model = Target()
    seen, looked_up = [], []
    model.embed.register_forward_hook(lambda m, args, out: looked_up.append(args[0].tolist()))

    def dflash_step(self, batch, on_publish=None):  # stand-in: embeds as DFLASH's step does
        ids = self._draft_block_ids_buf[: len(batch.seq_lens)]
        own = torch.tensor([[1, 2]])
        seen.append((self._q, model.get_input_embeddings()(ids),
                     model.get_input_embeddings()(own)))
        if batch.fail:
            raise RuntimeError("step failed")
        return "result"

    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", dflash_step)
    cls = w.worker_class()
    worker = cls.__new__(cls)
    worker.__dict__.update(
        _target_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)),
        _states={1: {}, 16: {}}, _q=1, _no_noise=None, _issued=[], _clock=StepClock(),
        ledger=LaunchLedger(gap_s=60),
        _steps=collections.Counter(), _log_every=0, _held=None, _held_reqs=(),
        _draft_block_ids_buf=torch.tensor([[3], [4], [5]]))
    worker._use = lambda q: worker.__dict__.update(_q=q)
    worker.policy = ServerPolicy(AdaptiveConfig(), {1: {1: 1.0, 16: 2.0}}, 16)
    mode = SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False)

    def batch(fail=False):
        return SimpleNamespace(forward_mode=mode, is_extend_in_batch=False,
                               seq_lens=torch.zeros(2), fail=fail)

    worker.policy.choose = lambda bs: 1
    assert worker.forward_batch_generation(batch()) == "result"
    q, noise, own = seen[-1]
    assert q == 1 and noise.shape == (2, 1, 4) and noise.dtype == model.embed.weight.dtype
    assert looked_up == [[[1, 2]]]  # the table saw the other ids only, never the block's
    assert torch.equal(own, model.embed(torch.tensor([[1, 2]])))
    assert "get_input_embeddings" not in vars(model)  # the class's method again
    with pytest.raises(RuntimeError, match="step failed"):
        worker.forward_batch_generation(batch(fail=True))
    assert "get_input_embeddings" not in vars(model)
    worker.policy.choose = lambda bs: 16
    worker.forward_batch_generation(batch())
    q, noise, _ = seen[-1]
    assert q == 16 and torch.equal(noise, model.embed(torch.tensor([[3], [4]])))
    assert worker.ledger.n["dd"] == 2  # three decode launches (the failed one too)
    assert worker.ledger.decodes == [3, 6]  # of 2 requests each
