"""DFLASH_TREE's fast acceptance at T > 0 (`sglang_tree_verify`) against SGLang 0.5.16, on CPU:
the per-round gate on a real `SamplingBatchInfo` (built by SGLang's `from_schedule_batch` from
real normalised `SamplingParams`), the server-wide gate on ServerArgs' fields, the node tokens
`target_choice` draws from SGLang's sampling fields (greedy rows the argmax), and `sglang_walk`,
the `=check` mode's call of SGLang's own tree walk (`verify_tree_greedy_func`, its Triton kernel
interpreted) on sampled tokens, against our walk. For `DFLASH_TREE_RRS`: its drafts over a
real padded `ParallelLMHead` (q over the real rows only), its stages' vocabulary check and its
gates. That the walks are lossless in distribution: `tests/dflash/test_tree_race.py`,
`tests/engines/test_sglang_tree_rrs.py`. Run with `checks_tree.py` (same environments);
skips on other SGLang versions.
"""

from types import SimpleNamespace as _ns

import pytest
import torch

from tests.engines.sglang_env import shims

shims.install()

from dflash_plugin.engines.sglang_tree_accept import Accepted, accept_round  # noqa: E402
from dflash_plugin.engines.sglang_tree_verify import (  # noqa: E402
    compare,
    round_slow_reason,
    sampling_slow_reason,
    sglang_walk,
    target_choice,
)
from tests.engines.sglang_env.checks_tree import OLD, _interpreted  # noqa: E402
from tests.engines.sglang_env.checks_tree_accept import _round  # noqa: E402

pytestmark = pytest.mark.skipif(not OLD, reason="the fast accept is written against SGLang 0.5.16")
VOCAB = 100


class _Batch:  # SGLang's penalizers keep a weak reference to the batch
    def __init__(self, reqs):
        self.reqs, self.device, self.has_grammar = reqs, "cpu", False


def batch_of(monkeypatch, *params) -> _Batch:
    """A batch of requests with these SamplingParams kwargs and SGLang's SamplingBatchInfo."""
    from sglang.srt.sampling import sampling_batch_info as sbi
    from sglang.srt.sampling.sampling_params import SamplingParams

    monkeypatch.setattr(sbi, "get_server_args", lambda: _ns(
        enable_deterministic_inference=False, enable_custom_logit_processor=False))
    b = _Batch([_ns(sampling_params=SamplingParams(**kw), custom_logit_processor=None,
                    return_sampling_mask=False) for kw in params])
    b.sampling_info = sbi.SamplingBatchInfo.from_schedule_batch(b, VOCAB)
    return b


def test_round_gate_on_sglangs_sampling_batch_info(monkeypatch):
    greedy, hot = dict(temperature=0.0), dict(temperature=0.8)
    assert round_slow_reason(batch_of(monkeypatch, greedy, greedy), True) is None
    assert round_slow_reason(batch_of(monkeypatch, hot), False) == "sampling"
    assert round_slow_reason(batch_of(monkeypatch, hot), True) is None
    assert round_slow_reason(batch_of(monkeypatch, greedy, hot, greedy), True) is None
    assert round_slow_reason(batch_of(monkeypatch, hot, dict(temperature=1.0, top_k=VOCAB)),
                             True) is None  # top-k of the whole vocabulary keeps every token
    assert round_slow_reason(batch_of(monkeypatch, hot, dict(temperature=1.0, top_k=50)),
                             True) == "top-k sampling"
    for kw in (dict(top_p=0.9), dict(min_p=0.1)):
        assert round_slow_reason(batch_of(monkeypatch, hot, dict(temperature=0.5, **kw)),
                                 True) == "top-p or min-p sampling"
    b = batch_of(monkeypatch, hot)
    b.has_grammar = True
    assert round_slow_reason(b, True) == "grammar"
    b = batch_of(monkeypatch, hot, dict(temperature=0.7, logit_bias={"3": 1.0}))
    assert round_slow_reason(b, True) == "penalties or logit bias"


def test_server_gate_reads_server_args_fields():
    from sglang.srt.server_args import ServerArgs

    fields = ServerArgs.__dataclass_fields__
    defaults = dict(speculative_use_rejection_sampling=False, tp_size=1,
                    speculative_accept_threshold_single=1.0,
                    speculative_accept_threshold_acc=1.0, enable_dp_attention=False)
    for name, value in defaults.items():
        assert fields[name].default == value, name
    assert sampling_slow_reason(_ns(**defaults)) is None
    for change, why in ((dict(speculative_use_rejection_sampling=True), "rejection"),
                        (dict(speculative_accept_threshold_acc=0.5), "thresholds"),
                        (dict(speculative_accept_threshold_single=0.9), "thresholds"),
                        (dict(tp_size=2), "rank"), (dict(enable_dp_attention=True), "rank")):
        assert why in sampling_slow_reason(_ns(**{**defaults, **change}))


def test_target_choice_on_sglangs_fields(monkeypatch):
    bs, w = 3, 5
    logits = torch.randn(bs * w, VOCAB, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1).view(bs, w)
    info = batch_of(monkeypatch, *[dict(temperature=0.0)] * bs).sampling_info
    assert torch.equal(target_choice(logits, info, bs, w), argmax)
    info = batch_of(monkeypatch, dict(temperature=0.0), dict(temperature=30.0),
                    dict(temperature=0.0)).sampling_info
    torch.manual_seed(1)
    got = target_choice(logits, info, bs, w)
    assert got.shape == (bs, w) and got.dtype == torch.long
    assert torch.equal(got[[0, 2]], argmax[[0, 2]])  # top-k 1 rows: the argmax
    assert not torch.equal(got[1], argmax[1])  # T = 30 over 100 tokens: samples


def test_check_walk_is_sglangs_tree_walk_of_the_sampled_tokens(monkeypatch):
    from sglang.srt.speculative import eagle_utils

    for flag in ("_is_cuda", "_is_hip", "_is_musa", "_is_cpu", "_is_npu"):
        monkeypatch.setattr(eagle_utils, flag, False)
    monkeypatch.setattr(eagle_utils, "_is_xpu", True)  # its branch: SGLang's Triton walk
    monkeypatch.setattr(eagle_utils, "verify_tree_greedy_kernel_triton",
                        _interpreted(eagle_utils.verify_tree_greedy_kernel_triton))
    for bs, g, k, n, seed in ((3, 7, 3, 16, 4), (2, 4, 2, 5, 9)):
        t, choice, seq_lens, _, _, loc, _ = _round(bs, g, k, n, seed)
        vi = _ns(draft_token=t.draft_token, retrieve_index=t.retrieve_index,
                 retrieve_next_token=t.retrieve_next_token,
                 retrieve_next_sibling=t.retrieve_next_sibling,
                 max_tree_depth=t.max_tree_depth, tree_topk=k)
        predict, accept_lens, accept_index = sglang_walk(vi, choice)
        out, _, n_path, bonus, _, _ = accept_round(
            choice, t.draft_token.view(bs, -1), t.parents, t.depths, loc.view(bs, -1),
            torch.ones(bs, dtype=torch.bool), g)
        assert accept_lens.tolist() == n_path.tolist() and max(n_path.tolist()) > 2
        compare(Accepted(out.view(-1), n_path, bonus, seq_lens + n_path), predict,
                accept_lens, accept_index, n + 1)
        with pytest.raises(RuntimeError, match="accept lengths"):
            compare(Accepted(out.view(-1), n_path + 1, bonus, seq_lens), predict,
                    accept_lens, accept_index, n + 1)


def test_rrs_sampled_topk_and_stages_on_a_real_padded_lm_head():
    """`DFLASH_TREE_RRS`'s drafts over SGLang's ParallelLMHead (padded to 128 rows for a
    vocabulary of 100): q covers the real rows only, no padded id is drawn, and the stages take
    the head for the model's vocabulary and refuse another."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.runtime_context import get_parallel

    from dflash_plugin.engines import sglang_tree_rrs as rrs

    with get_parallel().override(tp_rank=0, tp_size=1):
        head = ParallelLMHead(100, 8, params_dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(128, 8, generator=torch.Generator().manual_seed(0)))
        head.weight[100:] = 50.0  # padding that would take every draw if it were read
    hidden = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    top_lp, ids, q = rrs.sampled_topk(hidden, head, 4, torch.full((3, 1), 0.8))
    assert q.shape == (3, 5, 100) and int(ids.max()) < 100 and ids.shape == (3, 5, 4)
    assert torch.allclose(q.sum(-1), torch.ones(3, 5))
    assert (top_lp[..., :-1] >= top_lp[..., 1:]).all()  # the shape: q's sorted values
    plan = _ns(budget=8, topk=4, depth=5, width=9)
    made, why = rrs.stages(torch.device("cpu"), plan, head, 100, None, None, graphs=False,
                           triton=False)
    assert why is None and made[1].vocab == 100
    made, why = rrs.stages(torch.device("cpu"), plan, head, 128, None, None, graphs=False,
                           triton=False)
    assert made is None and "100" in why


def test_rrs_gates(monkeypatch):
    from dflash_plugin.engines import sglang_tree_rrs as rrs
    from dflash_plugin.errors import ConfigError

    worker = _ns(_fast_accept=False, _fast_sampling=False)
    assert rrs.rrs_stages(worker, "cpu", False, False) == (None, None)
    monkeypatch.setenv("DFLASH_TREE_RRS", "1")
    with pytest.raises(ConfigError, match="DFLASH_TREE_FAST_ACCEPT"):
        rrs.rrs_stages(worker, "cpu", False, False)
    worker._fast_accept = True
    assert "SGLang's acceptance" in rrs.rrs_stages(worker, "cpu", False, False)[1]
    hot, greedy = dict(temperature=0.8), dict(temperature=0.0)
    assert rrs.takes(batch_of(monkeypatch, hot, hot).sampling_info, 2)
    assert not rrs.takes(batch_of(monkeypatch, hot, greedy).sampling_info, 2)
    assert not rrs.takes(batch_of(monkeypatch, greedy).sampling_info, 1)
