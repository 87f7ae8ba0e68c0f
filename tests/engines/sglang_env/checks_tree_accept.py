"""DFLASH_TREE's greedy acceptance in one graph (`sglang_tree_accept`, `sglang_tree_verify`)
against SGLang 0.5.16's own EAGLE path, on CPU: SGLang's greedy tree verify, bonus fill and
target-KV move run their Triton kernels through Triton's interpreter (`verify_tree_greedy`,
`fill_bonus_tokens`, and inside the real `move_accept_tokens_to_target_kvcache`:
`assign_extend_cache_locs`, `fill_accept_out_cache_loc`), `_compact_accept_to_front` runs as
is; the pool is a stand-in whose `move_kv_cache` gathers then scatters (the tiled copy kernel's
order). Our stage must give the tokens the scheduler reads, the accept lengths, the bonus, the
same target KV and the drafter-append rows SGLang's compacted hidden states give. Then the
fast path's gate (`slow_reason`) on SGLang's sampling fields and the fixture's real model
config, and the calls `verify_fast` makes against 0.5.16's signatures. Run with
`checks_tree.py` (same environments); skips on other SGLang versions.
"""

import inspect
from types import SimpleNamespace as _ns

import pytest
import torch

from tests.engines.sglang_env import shims

shims.install()

from dflash_plugin.engines.sglang_tree_accept import (  # noqa: E402
    Accepted,
    AcceptStage,
    accept_round,
    path_rows,
)
from dflash_plugin.engines.sglang_tree_input import build_verify_tensors  # noqa: E402
from dflash_plugin.fast.tree_build import build_tree  # noqa: E402
from tests.engines.sglang_env.checks_tree import OLD, _sglang_greedy  # noqa: E402
from tests.engines.sglang_env.fixtures import FIX  # noqa: E402

OLD_ONLY = pytest.mark.skipif(not OLD, reason="the fast accept is written against SGLang 0.5.16")
SLOTS, CTX = 64, 96


class Pool:
    def __init__(self, seed):
        self.kv = torch.randn(SLOTS * CTX, 2, generator=torch.Generator().manual_seed(seed))

    def move_kv_cache(self, tgt, src):
        self.kv[tgt.long()] = self.kv[src.long()].clone()


def _round(bs, g, k, n, seed):
    vocab, w = 61, n + 1
    gen = torch.Generator().manual_seed(seed)
    top_lp, top_ids = torch.randn(bs, g, vocab, generator=gen).log_softmax(-1).topk(k, -1)
    tokens, parents, depths = build_tree(top_lp, top_ids, n)
    seq_lens = torch.randint(3, CTX - w - 1, (bs,), generator=gen)
    t = build_verify_tensors(tokens, parents, depths, torch.randint(0, vocab, (bs,)),
                             seq_lens, int(seq_lens.sum()), g)
    choice = torch.randint(0, vocab, (bs, w), generator=gen)
    for b in range(bs):  # follow a random child where there is one
        for node in range(w):
            kids = [i + 1 for i in range(n) if int(parents[b, i]) == node]
            if kids and float(torch.rand((), generator=gen)) < 0.85:
                choice[b, node] = tokens[b, kids[int(torch.randint(len(kids), (), generator=gen))]
                                         - 1]
    req_to_token = 1 + torch.randperm(SLOTS * CTX - 1, generator=gen)[:SLOTS * CTX // 2]
    req_to_token = req_to_token[:(SLOTS // 2) * CTX].view(SLOTS // 2, CTX).to(torch.int32)
    pool_idx = torch.randperm(SLOTS // 2, generator=gen)[:bs]
    loc = torch.cat([req_to_token[pool_idx[b], int(seq_lens[b]):int(seq_lens[b]) + w]
                     for b in range(bs)]).long()  # eagle_prepare_for_verify's out_cache_loc
    hidden = torch.randn(bs * w, 5, generator=gen)
    return t, choice, seq_lens, req_to_token, pool_idx, loc, hidden


CASES = [(3, 7, 3, 16), (1, 4, 2, 5), (4, 15, 4, 32)]
DUMP = """
import sys, torch
from tests.engines.sglang_env import legacy
legacy.install()
from tests.engines.sglang_env.checks_tree_accept import sglang_rounds
torch.save(sglang_rounds(), sys.argv[1])
print("DUMP-OK")
"""


def _sglang_path(t, choice, seq_lens, req_to_token, pool_idx, loc, hidden, pool):
    """SGLang 0.5.16's greedy acceptance, bonus, target-KV move and compaction (its Triton
    kernels call Triton's own jit'd helpers: run under TRITON_INTERPRET=1, `sglang_rounds`)."""
    from sglang.kernels.ops.speculative.eagle import fill_bonus_tokens_func
    from sglang.srt.speculative.eagle_worker_common import _compact_accept_to_front
    from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache

    bs, w = choice.shape
    predict, accept_index, num_correct = _sglang_greedy(t, choice)
    accept_lens = num_correct + 1
    bonus = torch.empty_like(accept_lens)
    fill_bonus_tokens_func(predict[accept_index], accept_lens, bonus, accept_index.shape[1], bs)
    batch = _ns(seq_lens=seq_lens, req_pool_indices=pool_idx, out_cache_loc=loc,
                req_to_token_pool=_ns(req_to_token=req_to_token))
    move_accept_tokens_to_target_kvcache(batch, accept_index, num_correct,
                                         _ns(get_kvcache=lambda: pool))
    predict = _compact_accept_to_front(predict, accept_index, bs, num_draft_tokens=w)
    hidden = _compact_accept_to_front(hidden, accept_index, bs, num_draft_tokens=w)
    return predict, accept_lens, bonus, hidden, pool.kv


def sglang_rounds() -> list:
    """SGLang's results for every (case, trial) of the test below (in the subprocess)."""
    out = []
    for bs, g, k, n in CASES:
        for trial in range(3):
            out.append(_sglang_path(*_round(bs, g, k, n, 10 * trial + n), Pool(trial)))
    return out


@OLD_ONLY
def test_stage_does_what_sglangs_eagle_path_does(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    dump = tmp_path / "sglang.pt"
    proc = subprocess.run([sys.executable, "-c", DUMP, str(dump)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert "DUMP-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    theirs = iter(torch.load(dump))
    for bs, g, k, n in CASES:
        for trial in range(3):
            t, choice, seq_lens, r2t, pool_idx, loc, hidden = _round(bs, g, k, n, 10 * trial + n)
            predict, accept_lens, bonus, compact, kv = next(theirs)
            ours, appended = Pool(trial), []
            stage = AcceptStage(torch.device("cpu"), ours.move_kv_cache,
                                lambda a=appended, **kw: a.append(kw), n + 1, g)
            acc = stage.run(choice, t, loc, hidden, seq_lens)
            assert torch.equal(ours.kv, kv), (n, trial)  # the same target KV everywhere
            assert acc.accept_lens.tolist() == accept_lens.tolist()
            assert acc.bonus.tolist() == bonus.tolist()
            assert acc.new_seq_lens.tolist() == (seq_lens + accept_lens).tolist()
            assert len(set(accept_lens.tolist())) > 1 or bs == 1  # varied paths
            w = n + 1
            for b, a in enumerate(accept_lens.tolist()):  # what the scheduler reads of a row
                assert acc.predict[b * w:b * w + a].tolist() == predict[b * w:b * w + a].tolist()
            kw = appended[-1]  # the drafter append (the bucket's rows): SGLang's compacted
            rows = kw["target_hidden"].view(-1, g + 1, hidden.shape[-1])  # rows, front slots
            for b, a in enumerate(accept_lens.tolist()):
                assert torch.equal(rows[b, :a], compact.view(bs, w, -1)[b, :a])
                assert kw["cache_loc_2d"][b].tolist() == loc.view(bs, w)[b, :g + 1].tolist()
            assert kw["commit_lens"][:bs].tolist() == accept_lens.tolist()
            assert not kw["commit_lens"][bs:].any()  # padded rows write nothing


@OLD_ONLY
def test_check_mode_compares_with_sglangs_acceptance():
    from dflash_plugin.engines.sglang_tree_verify import compare

    bs, g, k, n = 3, 7, 3, 16
    t, choice, seq_lens, r2t, pool_idx, loc, hidden = _round(bs, g, k, n, 5)
    predict, accept_index, num_correct = _sglang_greedy(t, choice)
    out, path, n_path, bonus, _, _ = accept_round(choice, t.draft_token.view(bs, -1), t.parents,
                                                  t.depths, loc.view(bs, -1),
                                                  torch.ones(bs, dtype=torch.bool), g)
    acc = Accepted(out.view(-1), n_path, bonus, seq_lens + n_path)
    compare(acc, predict, num_correct + 1, accept_index, n + 1)
    assert path_rows(hidden.view(bs, n + 1, -1), loc.view(bs, -1), path, n_path, seq_lens)[3] \
        .tolist() == (num_correct + 1).tolist()
    bad = acc.predict.clone()
    b = int(torch.argmax(num_correct))
    bad[b * (n + 1) + int(num_correct[b])] += 1  # the bonus of the longest path
    with pytest.raises(RuntimeError, match="accepted"):
        compare(type(acc)(bad, acc.accept_lens, acc.bonus, acc.new_seq_lens), predict,
                num_correct + 1, accept_index, n + 1)
    with pytest.raises(RuntimeError, match="accept lengths"):
        compare(acc, predict, num_correct + 2, accept_index, n + 1)


@OLD_ONLY
def test_slow_reason_reads_sglangs_fields_and_the_real_model_config():
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    from dflash_plugin.engines.sglang_tree_verify import slow_reason

    fields = {f.name for f in SamplingBatchInfo.__dataclass_fields__.values()}
    assert {"is_all_greedy", "acc_additive_penalties", "acc_scaling_penalties",
            "logit_bias"} <= fields
    mc = ModelConfig(str(FIX / "code-target"))
    worker = _ns(model_runner=_ns(model_config=mc))
    info = dict(is_all_greedy=True, acc_additive_penalties=None, acc_scaling_penalties=None,
                logit_bias=None)

    def batch(**kw):
        return _ns(sampling_info=_ns(**{**info, **kw}), has_grammar=kw.pop("grammar", False))

    kv = _ns()
    assert slow_reason(batch(), worker, kv) is None
    assert slow_reason(batch(is_all_greedy=False), worker, kv) == "sampling"
    assert slow_reason(batch(grammar=True), worker, kv) == "grammar"
    assert slow_reason(batch(logit_bias=torch.zeros(1, 4)), worker, kv) == \
        "penalties or logit bias"
    assert slow_reason(batch(), worker, _ns(clear_unaccepted_c128_draft_states=print)) == \
        "the pool clears unaccepted draft states"


@OLD_ONLY
def test_verify_fast_calls_match_sglang_signatures():
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative import eagle_utils, spec_utils
    from sglang.srt.speculative.eagle_worker_common import run_eagle_verify
    from sglang.srt.utils import async_probe

    assert list(inspect.signature(eagle_utils.eagle_prepare_for_verify).parameters) == [
        "verify_input", "req_to_token_pool", "batch", "target_worker"]
    assert list(inspect.signature(eagle_utils.eagle_sample).parameters) == [
        "verify_input", "batch", "logits_output", "vocab_mask"]
    assert list(inspect.signature(spec_utils.record_stream_for_v2_verify).parameters) == [
        "batch", "verify_input", "fwd_stream"]
    assert list(inspect.signature(spec_utils.record_stream_each).parameters) == [
        "tensors", "stream"]
    assert list(inspect.signature(async_probe.sanitize_nan_logits).parameters) == [
        "logits", "msg"]
    assert {"batch", "forward_batch", "is_verify"} <= set(
        inspect.signature(TpModelWorker.forward_batch_generation).parameters)
    fields = set(GenerationBatchResult.__dataclass_fields__)
    assert {"logits_output", "next_token_ids", "can_run_cuda_graph",
            "speculative_num_draft_tokens", "next_draft_input", "accept_lens", "new_seq_lens",
            "routed_experts_output", "indexer_topk_output", "extra_keep_alive_refs"} <= fields
    # the calls run_eagle_verify makes before its acceptance are the ones verify_fast makes
    src = inspect.getsource(run_eagle_verify)
    head = src[:src.index("eagle_sample(verify_input")]
    for call in ("record_stream_for_v2_verify(batch, verify_input, fwd_stream)",
                 "eagle_prepare_for_verify(", "record_stream_each((batch.input_ids, "
                 "batch.out_cache_loc), fwd_stream)", "is_verify=True"):
        assert call in head, call
    # what the scheduler reads of next_token_ids: accept_lens[i] entries from i * stride
    import sglang.srt.managers.scheduler_components.batch_result_processor as brp

    assert "next_token_ids[i * stride : i * stride + accept_lens[i]]" in inspect.getsource(brp)
