"""DFLASH_TREE's worker against SGLang 0.5.16's real source (static conformance): what it imports,
subclasses, calls, reads and writes exists there with the signatures and fields it assumes.
Nothing that needs a GPU runs; where an SGLang function is called, only with CPU tensors, and
stand-in `self` / runner objects carry only the attributes that function reads. Run with
`checks_tree.py` (same environments); the checks skip on other SGLang versions.
"""

import inspect

import pytest
import torch

from tests.engines.sglang_env import shims

shims.install()

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.speculative.spec_registry import get_spec  # noqa: E402

from dflash_plugin.engines.sglang import register  # noqa: E402
from dflash_plugin.engines.sglang_tree_input import build_verify_tensors  # noqa: E402
from dflash_plugin.fast.tree_build import build_tree  # noqa: E402
from tests.engines.sglang_env.checks_tree import OLD, _server_args, _sglang_greedy  # noqa: E402


def test_worker_imports_for_the_supported_version_only():
    from dflash_plugin.engines import sglang_tree_worker as w

    if not OLD:
        with pytest.raises(RuntimeError, match="not supported yet"):
            w.worker_class()
        return
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.eagle_worker_common import run_eagle_verify

    cls = w.worker_class()
    assert issubclass(cls, DFlashWorkerV2)
    assert w.worker_factory(None) is cls
    # what the worker calls, with the arguments it passes (0.5.16 source)
    kw = set(inspect.signature(run_eagle_verify).parameters)
    assert kw == {"batch", "target_worker", "req_to_token_pool", "token_to_kv_pool_allocator",
                  "plan_stream", "plan_stream_ctx", "topk", "num_steps", "num_draft_tokens",
                  "device", "metadata_ready_pre_pad", "finalize_tree_path"}
    assert list(inspect.signature(DFlashWorkerV2.__init__).parameters) == [
        "self", "server_args", "gpu_id", "ps", "nccl_port", "target_worker"]
    for name in ("_ensure_draft_block_buffers", "_append_target_hidden_to_draft_kv_by_loc",
                 "_make_next_draft_input_decode", "_maybe_build_draft_sampler"):
        assert callable(getattr(DFlashWorkerV2, name)), name
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    assert list(inspect.signature(DecodeCudaGraphRunner.get_spec_info).parameters) == [
        "self", "num_tokens"]


# --- the worker against SGLang 0.5.16's real source (static conformance; nothing is run that
# needs a GPU; where an SGLang function is called, only with CPU tensors, and stand-in `self` /
# runner objects carry only the attributes that function reads) ------------------------------

OLD_ONLY = pytest.mark.skipif(not OLD, reason="the worker is written against SGLang 0.5.16")


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _self_attrs(tree, class_name: str) -> tuple[set[str], set[str]]:
    """(read, assigned) names of `self.<name>` anywhere in class `class_name` of an AST."""
    import ast

    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    read, stored = set(), set()
    for n in ast.walk(cls):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            (stored if isinstance(n.ctx, ast.Store) else read).add(n.attr)
    return read, stored


@OLD_ONLY
def test_worker_reads_only_attributes_dflash_worker_v2_sets():
    """Every `self.<name>` the tree worker reads is its own, or set / defined by 0.5.16's
    DFlashWorkerV2 (or BaseSpecWorker). DFlashWorkerV2.__getattr__ forwards unknown names to the
    target worker, so a misspelt buffer name would not fail where it is read."""
    import ast

    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dflash_plugin.engines import sglang_tree_worker as w

    ours_read, ours_set = _self_attrs(ast.parse(inspect.getsource(w)), "DFlashTreeWorker")
    ours_set |= {n for n in vars(w.worker_class()) if not n.startswith("__")}
    _, base_set = _self_attrs(ast.parse(inspect.getsource(inspect.getmodule(DFlashWorkerV2))),
                              "DFlashWorkerV2")
    missing = {n for n in ours_read - ours_set - base_set if not hasattr(DFlashWorkerV2, n)}
    assert not missing, missing
    # the buffers the draft block uses exist after _ensure_draft_block_buffers
    src = inspect.getsource(DFlashWorkerV2._ensure_draft_block_buffers)
    for name in ("_draft_block_ids_buf", "_draft_block_positions_buf", "_draft_seq_lens_cpu_buf"):
        assert f"self.{name} = torch.empty" in src, name


@OLD_ONLY
def test_worker_calls_match_sglang_signatures():
    """Parameter names / order of every SGLang callable the worker calls or overrides."""
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dflash_plugin.engines import sglang_tree_worker as w

    cls = w.worker_class()
    # the scheduler builds the worker with these keywords (managers/scheduler.py,
    # maybe_init_draft_worker) and calls forward_batch_generation(batch[, on_publish=...])
    assert _params(cls.__init__) == _params(DFlashWorkerV2.__init__)
    assert _params(cls.forward_batch_generation) == _params(
        DFlashWorkerV2.forward_batch_generation) == ["self", "batch", "on_publish"]
    assert _params(cls._maybe_build_draft_sampler) == _params(
        DFlashWorkerV2._maybe_build_draft_sampler) == ["self"]
    assert _params(DFlashWorkerV2._ensure_draft_block_buffers) == ["self", "bs"]
    assert _params(DFlashWorkerV2._make_next_draft_input_decode) == [
        "self", "bonus_tokens", "new_seq_lens"]
    append = inspect.signature(DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc)
    assert set(append.parameters) - {"self"} == {
        "target_hidden", "cache_loc", "positions", "cache_loc_2d", "commit_lens"}
    assert _params(assign_extend_cache_locs_func) == [
        "req_pool_indices", "req_to_token", "start_offset", "end_offset", "batch_size",
        "draft_token_num", "device"]
    assert _params(ServerArgs.override)[:2] == ["self", "source"]
    assert _params(ModelRunner.forward)[:2] == ["self", "forward_batch"]
    # DFlashWorkerV2 keeps BaseSpecWorker's WAR runner (the target's): republish_read_done
    # re-records the event on that runner
    assert DFlashWorkerV2.war_fastpath_runner is BaseSpecWorker.war_fastpath_runner
    mr = object()
    assert BaseSpecWorker.war_fastpath_runner.fget(
        _ns(target_worker=_ns(model_runner=mr))) is mr


def _ns(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(**kw)


@OLD_ONLY
def test_war_barrier_contract_the_worker_relies_on():
    """The scheduler fences its next shared-buffer writes on the WAR runner's read-done event;
    a DFLASH-family TARGET_VERIFY graph records it before replay; SGLang's tree compaction
    (run by our verify) reads req_to_token after it: hence `republish_read_done`."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative import eagle_worker_common, spec_utils

    from dflash_plugin.engines.sglang_tree_verify import republish_read_done

    barrier = inspect.getsource(Scheduler._apply_war_barrier)
    assert "self.model_worker.war_fastpath_runner" in barrier
    assert "war_fastpath_read_done_event" in barrier
    assert "self.war_fastpath_read_done_event" in inspect.getsource(ModelRunner.__init__)
    execute = inspect.getsource(DecodeCudaGraphRunner)
    assert "is_target_verify()\n            and self.model_runner.spec_algorithm" \
        ".is_dflash_family()" in execute
    assert "move_accept_tokens_to_target_kvcache" in inspect.getsource(
        eagle_worker_common._finalize_accept_tree_path)
    assert "batch.req_to_token_pool.req_to_token" in inspect.getsource(
        spec_utils.move_accept_tokens_to_target_kvcache)
    runner = _ns(war_fastpath_read_done_event=None)
    republish_read_done(runner, "cpu")  # no fast-path event: the coarse barrier stays
    assert runner.war_fastpath_read_done_event is None


@OLD_ONLY
def test_sglang_data_fields_the_worker_reads_and_writes():
    import dataclasses

    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput
    from sglang.srt.model_executor.runner_utils.buffers import DecodeInputBuffers
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.eagle_info import EagleDraftInput, EagleVerifyInput

    def fields(c):
        return {f.name for f in dataclasses.fields(c)}

    assert {"logits_output", "next_token_ids", "accept_lens", "new_seq_lens", "next_draft_input",
            "speculative_num_draft_tokens", "can_run_cuda_graph"} <= fields(GenerationBatchResult)
    assert {"logits_output", "can_run_graph"} <= fields(ModelRunnerOutput)
    assert "hidden_states" in fields(LogitsProcessorOutput)
    assert {"bonus_tokens", "new_seq_lens", "reserved_seq_lens_cpu",
            "reserved_seq_lens_sum"} <= fields(DFlashDraftInputV2)
    assert "bonus_tokens" in fields(EagleDraftInput)
    assert "custom_mask" in fields(DecodeInputBuffers)
    assert {"draft_token", "custom_mask", "positions", "retrieve_index", "retrieve_next_token",
            "retrieve_next_sibling", "retrieve_cum_len", "spec_steps", "topk", "draft_token_num",
            "capture_hidden_mode", "seq_lens_sum", "seq_lens_cpu"} <= fields(EagleVerifyInput)
    # the two tree properties our verify input overrides are properties of EagleVerifyInput
    assert isinstance(inspect.getattr_static(EagleVerifyInput, "max_tree_depth"), property)
    assert isinstance(inspect.getattr_static(EagleVerifyInput, "tree_topk"), property)
    from sglang.srt.server_args import ServerArgs

    read = {"speculative_dflash_block_size", "speculative_num_draft_tokens",
            "speculative_eagle_topk", "speculative_num_steps", "speculative_draft_window_size",
            "speculative_accept_threshold_single", "speculative_accept_threshold_acc",
            "speculative_use_rejection_sampling", "enable_mixed_chunk", "max_running_requests",
            "page_size", "pp_size", "tp_size", "enable_dp_attention", "attention_backend",
            "device", "trust_remote_code", "model_path", "speculative_draft_model_path"}
    assert read <= fields(ServerArgs), read - fields(ServerArgs)
    # DFlashWorkerV2 takes its block from speculative_num_draft_tokens (why the drafter copy
    # carries L), and build_draft_tp_worker deep-copies the args it is given
    from sglang.srt.speculative import draft_worker_common
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    assert "self.block_size = int(server_args.speculative_num_draft_tokens)" in \
        inspect.getsource(DFlashWorkerV2.__init__)
    assert "deepcopy(server_args)" in inspect.getsource(draft_worker_common.build_draft_tp_worker)


@OLD_ONLY
def test_draft_server_args_through_override_on_real_server_args(monkeypatch):
    """Our `handle_server_args` on SGLang's own resolution (`--device cuda` resolves on CPU in
    0.5.16), then the drafter's copy: the worker's `draft_server_args` must work under
    SGLANG_STRICT_CONFIG_MUTATION (where a bare assignment raises) and leave the global args
    alone."""
    import copy

    from dflash_plugin.engines.sglang_tree_worker import draft_server_args

    register()
    sa = _server_args("--speculative-num-draft-tokens", "9", "--device", "cuda")
    assert (sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_dflash_block_size,
            sa.max_running_requests, sa.enable_mixed_chunk) == (1, 8, 9, 48, False)
    monkeypatch.setenv("SGLANG_STRICT_CONFIG_MUTATION", "1")
    with pytest.raises(AttributeError, match="override"):
        copy.deepcopy(sa).speculative_num_draft_tokens = 5
    d = draft_server_args(sa, 5)
    assert (d.speculative_num_draft_tokens, d.speculative_eagle_topk) == (5, 1)
    assert (sa.speculative_num_draft_tokens, sa.speculative_eagle_topk) == (9, 8)
    assert getattr(sa, "_runtime_mutations", None) != d._runtime_mutations


@OLD_ONLY
def test_tree_topk_skips_the_padded_rows_of_a_real_lm_head():
    """SGLang's ParallelLMHead pads its weight to a multiple of 64 rows; a padded row must
    never be drafted (their ids are past the vocab)."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.runtime_context import get_parallel

    from dflash_plugin.engines.sglang_tree_tp import tree_topk

    with get_parallel().override(tp_rank=0, tp_size=1):
        head = ParallelLMHead(100, 8, params_dtype=torch.bfloat16)
    assert tuple(head.weight.shape) == (128, 8) and head.shard_indices.num_org_elements == 100
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.weight.copy_(torch.randn(128, 8, generator=gen).to(torch.bfloat16))
        head.weight[100:] = 50.0  # padding that would win every top-K if it were read
    hidden = torch.randn(3, 5, 8, generator=gen)  # float32: cast to the head's dtype
    top_lp, top_ids = tree_topk(hidden, head, 4)
    assert top_ids.shape == (3, 5, 4) and int(top_ids.max()) < 100
    want = (hidden.to(torch.bfloat16) @ head.weight[:100].T).float().log_softmax(-1).topk(4)
    assert torch.equal(top_ids, want.indices) and torch.allclose(top_lp, want.values)


@OLD_ONLY
def test_draft_block_forward_batch_constructs_with_sglang_classes():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative.draft_worker_common import make_draft_block_spec_info
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from dflash_plugin.engines.sglang_tree_worker import draft_block_forward_batch

    bs, L, h = 2, 4, 8
    spec = make_draft_block_spec_info(draft_token_num=L, device=torch.device("cpu"))
    seq_lens = torch.tensor([5, 9])
    fb = draft_block_forward_batch(
        block_ids=torch.zeros(bs, L, dtype=torch.long),
        positions=seq_lens[:, None] + torch.arange(L), cache_loc=torch.arange(bs * L),
        req_pool_indices=torch.arange(bs), seq_lens=seq_lens,
        seq_lens_cpu=(seq_lens + L).to(torch.int32), seq_lens_sum=int(seq_lens.sum()) + bs * L,
        input_embeds=torch.zeros(bs, L, h), spec_info=spec)
    assert fb.forward_mode == ForwardMode.TARGET_VERIFY and fb.batch_size == bs
    assert fb.spec_algorithm is SpeculativeAlgorithm.DFLASH and fb.spec_info is spec
    assert fb.capture_hidden_mode == CaptureHiddenMode.NULL
    assert fb.input_ids.shape == (bs * L,) and fb.positions.shape == (bs * L,)
    assert fb.input_embeds.shape == (bs * L, h)


@OLD_ONLY
def test_capture_hook_is_applied_and_builds_a_masked_tree_input():
    """After SGLang's plugin loading, `DecodeCudaGraphRunner.get_spec_info` is HookRegistry's
    AROUND wrapper (original_fn, self, num_tokens); for DFLASH_TREE's target runner it returns
    our tree input carrying the runner's mask buffer; other algorithms get SGLang's own."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.ngram_info import NgramVerifyInput
    from sglang.srt.speculative.spec_info import SpecInputType

    from dflash_plugin.engines.sglang_tree_input import verify_input_class

    register()
    hooked = DecodeCudaGraphRunner.get_spec_info
    assert hasattr(hooked, "__wrapped__"), "the capture hook was not applied"
    init = inspect.getsource(DecodeCudaGraphRunner.__init__)
    assert "self.buffers: DecodeInputBuffers" in init and "self.captured_req_width =" in init
    buf = torch.ones(40, dtype=torch.bool)

    def runner(algo, draft=False):
        return _ns(model_runner=_ns(spec_algorithm=algo, is_draft_worker=draft,
                                    server_args=_ns(speculative_eagle_topk=4)),
                   buffers=_ns(custom_mask=buf), captured_req_width=9)

    spec = hooked(runner(get_spec("DFLASH_TREE")), 9 * 4)
    assert type(spec) is verify_input_class() and spec.custom_mask is buf
    assert spec.spec_input_type == SpecInputType.EAGLE_VERIFY
    assert (spec.draft_token_num, spec.num_tokens_per_req, spec.topk) == (9, 9, 4)
    assert spec.capture_hidden_mode == CaptureHiddenMode.FULL
    other = hooked(runner(SpeculativeAlgorithm.NGRAM), 9 * 4)  # SGLang's own branch
    assert type(other) is NgramVerifyInput and other.custom_mask is buf


@OLD_ONLY
def test_verify_tensor_dtypes_match_sglang_eagle_inputs():
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    idle = EagleVerifyInput.create_idle_input(topk=2, spec_steps=1, num_verify_tokens=4,
                                             device="cpu")
    tokens, parents, depths = torch.tensor([[4, 5, 6]]), torch.tensor([[0, 0, 1]]), \
        torch.tensor([[1, 1, 2]])
    t = build_verify_tensors(tokens, parents, depths, torch.tensor([3]), torch.tensor([7]), 7, 2)
    for name in ("draft_token", "positions", "retrieve_index", "retrieve_next_token",
                 "retrieve_next_sibling", "custom_mask"):
        assert getattr(t, name).dtype == getattr(idle, name).dtype, name


@OLD_ONLY
@pytest.mark.parametrize("bs,g,k,n", [(3, 7, 3, 16), (1, 4, 2, 5)])
def test_compaction_then_drafter_kv_args_pass_sglang(bs, g, k, n):
    """SGLang's greedy tree verify (its Triton kernel, interpreted) -> SGLang's own
    `_compact_accept_to_front` on the verify's hidden states -> our `accepted_path` and
    `append_kwargs`: the first commit rows are the accepted path's hidden states at consecutive
    positions and slots; DFLASH's `_append_target_hidden_to_draft_kv_by_loc` accepts those
    arguments (its checks run until the drafter projection, where a stand-in stops it)."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.eagle_worker_common import _compact_accept_to_front

    from dflash_plugin.engines.sglang_tree_append import accepted_path, append_kwargs

    vocab, w = 61, n + 1
    gen = torch.Generator().manual_seed(bs * 10 + n)
    top_lp, top_ids = torch.randn(bs, g, vocab, generator=gen).log_softmax(-1).topk(k, -1)
    tokens, parents, depths = build_tree(top_lp, top_ids, n)
    seq_lens = torch.randint(3, 30, (bs,), generator=gen)
    t = build_verify_tensors(tokens, parents, depths, torch.zeros(bs, dtype=torch.long),
                             seq_lens, int(seq_lens.sum()), g)
    choice = torch.randint(0, vocab, (bs, w), generator=gen)
    for b in range(bs):  # follow the first child where there is one
        for node in range(w):
            c = int(t.retrieve_next_token[b, node])
            if c >= 0:
                choice[b, node] = t.draft_token.view(bs, w)[b, c]
    _, accept_index, accept_num = _sglang_greedy(t, choice)
    hidden = torch.arange(bs * w, dtype=torch.float32)[:, None].repeat(1, 3)  # row id
    compact = _compact_accept_to_front(hidden, accept_index, bs, num_draft_tokens=w)
    slots = 1000 + torch.arange(bs * w)  # the verify's out_cache_loc
    commit = accept_num + 1
    kw = append_kwargs(*accepted_path(compact, slots, seq_lens, commit, w, g + 1))
    for b in range(bs):
        a = int(commit[b])
        rows = kw["target_hidden"].view(bs, g + 1, 3)[b, :a, 0].long().tolist()
        assert rows == accept_index[b, :a].tolist()  # root, then the accepted nodes
        assert kw["cache_loc_2d"][b].tolist() == list(range(1000 + b * w, 1000 + b * w + g + 1))
        assert kw["positions"].view(bs, g + 1)[b].tolist() == list(
            range(int(seq_lens[b]), int(seq_lens[b]) + g + 1))

    class Stop(Exception):
        pass

    def stop(_):
        raise Stop

    me = _ns(model_runner=_ns(device=torch.device("cpu")),
             draft_model=_ns(project_target_hidden=stop))
    with pytest.raises(Stop):  # every argument check of DFLASH's append passed
        DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc(me, **kw)

