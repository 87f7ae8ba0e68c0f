"""DFLASH_TREE's walk by recursive rejection sampling (`sglang_tree_rrs`) without SGLang: the
sampled tree phase and the walk as the worker runs them (`SampledTreeStage`, `RejectionStage`,
CPU, eager) emit the target's distribution: on the reference tests' tree (three depth-1
siblings drawn from q, two children under the first; `tests/dflash/test_tree.py`), the first
token follows the target at the root and the second, after a kept depth-1 node x, the target
after x (chi-square), with temperatures applied to both the drafter's and the target's logits.
A walk that forgets the temperature fails the same test. The stages' wiring: their outputs are
those of the direct calls, padded rows move and append nothing, and the kernel option asks for
the Triton walk."""

import pytest
import torch

from dflash_plugin.engines import sglang_tree_rrs as rrs
from dflash_plugin.engines.sglang_tree_input import tree_parts
from dflash_plugin.engines.sglang_tree_stage import first_rows
from dflash_plugin.fast.tree_build import build_tree
from tests.dflash.test_tree import (
    RRS_P_NEXT,
    RRS_P_ROOT,
    RRS_PARENTS,
    RRS_Q,
    RRS_V,
    rrs_check,
)

TRIALS, T = 40000, 0.7


class Head:  # an LM head whose logits over one-hot hidden rows are `rows` [D, V]
    def __init__(self, rows: torch.Tensor):
        self.weight = rows.t().contiguous()  # [V, D]


def drafter_head():
    return Head(T * RRS_Q.clamp_min(1e-30).log())  # softmax(logits / T) = q


def round_inputs(seed: int):
    """The sampled trees (one per trial) and the target's logits at every tree index."""
    torch.manual_seed(seed)
    hidden = torch.eye(2).expand(TRIALS, 2, 2)
    temps = torch.full((TRIALS, 1), T)
    top_lp, ids, q = rrs.sampled_topk(hidden, drafter_head(), 3, temps)
    tokens, parents, depths = build_tree(top_lp, ids, 5)
    assert (parents == torch.tensor(RRS_PARENTS)).all()  # the shape comes from q's values only
    p = torch.empty(TRIALS, 6, RRS_V)
    p[:, 0] = RRS_P_ROOT
    p[:, 1:] = RRS_P_NEXT[tokens]  # a depth-1 node's p follows its token; depth 2: unused
    draft = torch.cat([torch.zeros(TRIALS, 1, dtype=torch.long), tokens], 1)
    full_parents = torch.cat([torch.zeros(TRIALS, 1, dtype=torch.long), parents], 1)
    return T * p.log(), temps, q, draft, full_parents


def emitted(out):
    predict, _, n, _, _, _ = out
    first = predict[:, 0].long()
    second = torch.where(n >= 2, predict[:, 1].long(), -1)
    return first, second


def test_rrs_round_emits_the_targets_distribution():
    logits, temps, q, draft, parents = round_inputs(1)
    torch.manual_seed(2)
    loc = torch.arange(6).expand(TRIALS, 6)
    live = torch.ones(TRIALS, dtype=torch.bool)
    out = rrs.rrs_round(logits, temps, q, draft, parents, loc, live, 3)
    rrs_check(*emitted(out))
    assert (out[2] >= 1).all() and (out[2] <= 3).all()
    with pytest.raises(AssertionError):  # control: the target's logits without the temperature
        rrs_check(*emitted(rrs.rrs_round(logits, torch.ones_like(temps), q, draft, parents,
                                         loc, live, 3)))


class Plan:
    budget, topk, depth, width = 5, 3, 2, 6


def test_stages_do_what_the_direct_calls_do():
    bs, h = 4, 4  # a bucket's size: no padded rows, so both draw the same random numbers
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(2, RRS_V, generator=gen)
    head = Head(rows)
    moved, appended = [], []
    made, why = rrs.stages(torch.device("cpu"), Plan, head, RRS_V,
                           lambda tgt, src: moved.append((tgt, src)),
                           lambda **kw: appended.append(kw), graphs=False, triton=False)
    assert why is None
    tree_stage, accept = made
    hidden = torch.eye(2).expand(bs, 2, 2).contiguous()
    bonus, seq_lens = torch.tensor([3, 1, 4, 0]), torch.tensor([7, 9, 5, 6])
    temps = torch.tensor([[0.5], [1.0], [1.5], [0.8]])
    torch.manual_seed(11)
    t, q = tree_stage.run(hidden, bonus, seq_lens, temps)
    torch.manual_seed(11)
    top_lp, ids, q_ref = rrs.sampled_topk(hidden, head, 3, temps)
    tok, par, dep = build_tree(top_lp, ids, 5)
    want = tree_parts(tok, par, dep, bonus, seq_lens, 2)
    assert torch.equal(q, q_ref) and torch.equal(t.draft_token, want.draft_token)
    assert torch.allclose(q.sum(-1), torch.ones(bs, 2))
    logits = torch.randn(bs * 6, RRS_V, generator=gen)
    loc = torch.arange(100, 100 + bs * 6)
    hid = torch.randn(bs * 6, h, generator=gen)
    torch.manual_seed(12)
    acc = accept.run(logits, temps, q, t, loc, hid, seq_lens)
    torch.manual_seed(12)
    ref = rrs.rrs_round(logits.view(bs, 6, -1), temps, q, t.draft_token.view(bs, 6), t.parents,
                        loc.view(bs, 6), torch.ones(bs, dtype=torch.bool), 3)
    assert acc.accept_lens.tolist() == ref[2].tolist()
    assert acc.bonus.tolist() == ref[3].tolist()
    assert acc.new_seq_lens.tolist() == (seq_lens + ref[2]).tolist()
    tgt, src = moved[-1]
    assert tgt.tolist() == ref[4].reshape(-1).tolist()
    assert src.tolist() == ref[5].reshape(-1).tolist()
    assert appended[-1]["commit_lens"].tolist() == ref[2].tolist()
    acc3 = accept.run(logits[:18], temps[:3], q[:3], first_rows(t, 3), loc[:18], hid[:18],
                      seq_lens[:3])
    tgt, src = moved[-1]  # the padded fourth row: slot 0 onto itself, nothing appended
    assert len(acc3.accept_lens) == 3 and not tgt.view(4, -1)[3].any()
    assert not src.view(4, -1)[3].any() and appended[-1]["commit_lens"][3] == 0


def test_rrs_takes_only_small_batches_without_greedy_rows():
    class Info:
        is_all_greedy, is_any_greedy = False, False

    assert rrs.takes(Info, rrs.MAX_BS) and not rrs.takes(Info, rrs.MAX_BS + 1)
    Info.is_any_greedy = True
    assert not rrs.takes(Info, 1)
    made, why = rrs.stages(torch.device("cpu"), Plan, Head(torch.zeros(2, 70)), 64, None, None,
                           graphs=False, triton=False)
    assert made is None and "70" in why and "64" in why


def test_env_value_is_checked(monkeypatch):
    from dflash_plugin.errors import ConfigError

    assert not rrs.rrs_from_env({}) and rrs.rrs_from_env({"DFLASH_TREE_RRS": "1"})
    with pytest.raises(ConfigError, match="DFLASH_TREE_RRS"):
        rrs.rrs_from_env({"DFLASH_TREE_RRS": "yes"})
