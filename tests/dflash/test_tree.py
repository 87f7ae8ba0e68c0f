"""Tree drafting: exact tables for the tree build and the walk, then the loop end to end.

Greedy tree decoding must be token-identical to plain decoding (fp32, batch 1 and 4, ragged,
stop tokens mid-tree); an oracle whose top-1 draft is wrong but whose second choice is right must
be accepted through the tree; sampled tree decoding must follow the target's distribution
(chi-square over every 3-token continuation, as tests/dflash/test_sampling.py does).
"""

import math

import pytest
import torch

from dflash_plugin.errors import ConfigError
from dflash_plugin.generate import speculative_generate
from dflash_plugin.proposers import DFlashProposer
from dflash_plugin.sampling import SamplingParams
from dflash_plugin.tree import (
    Tree,
    build_tree,
    capacity,
    rejection_walk,
    sample_ranks,
    tree_mask,
    walk_tree,
)
from dflash_plugin.tree_generate import tree_generate
from tests.conftest import VOCAB, fitted_drafter, greedy_reference
from tests.dflash.test_sampling import (  # noqa: F401 (small: a fixture)
    NEW,
    PROMPT,
    V,
    chi2_pvalue,
    exact_distribution,
    small,
)

PROMPTS = [[5, 17, 29, 41], [7, 19, 31, 43], [9, 8, 7, 6, 5, 4], [60, 61], [11, 23, 35, 47, 2, 90]]


def logprobs(rows: list[dict[int, float]], vocab: int = 6) -> torch.Tensor:  # [g, vocab]
    """Per depth {token: probability}; the rest of the mass spread evenly over other tokens."""
    out = torch.empty(len(rows), vocab)
    for d, probs in enumerate(rows):
        rest = (1 - sum(probs.values())) / (vocab - len(probs))
        out[d] = torch.tensor([probs.get(t, rest) for t in range(vocab)]).log()
    return out


# ---- build_tree: exact node tables -----------------------------------------------------------
def test_build_tree_best_first_order():
    lp = logprobs([{1: 0.6, 2: 0.3}, {4: 0.9, 5: 0.05}, {0: 0.5, 3: 0.4}])
    t = build_tree(lp, budget=5, topk=2)
    # scores: [1] .6, [1,4] .54, [2] .3, [1,4,0] .27, [2,4] .27 (tie: pushed first wins)
    assert t.tokens == [1, 4, 2, 0, 4]
    assert t.parents == [0, 1, 0, 2, 3]
    assert t.depths == [1, 2, 1, 3, 2]
    assert all(p < i + 1 for i, p in enumerate(t.parents))  # a parent precedes its children


def test_build_tree_topk_one_is_the_linear_draft():
    lp = logprobs([{1: 0.6}, {4: 0.9}, {0: 0.5}, {2: 0.7}])
    t = build_tree(lp, budget=10, topk=1)
    assert t.tokens == [1, 4, 0, 2] and t.parents == [0, 1, 2, 3] and t.depths == [1, 2, 3, 4]


def test_build_tree_keeps_the_most_probable_prefixes():
    torch.manual_seed(0)
    lp = torch.randn(4, 9).log_softmax(-1)
    t = build_tree(lp, budget=12, topk=3)
    top, ids = lp.topk(3, -1)

    def score(i):  # summed log-prob of node i's prefix, from its parents
        s = 0.0
        while i >= 0:
            d = t.depths[i] - 1
            s += lp[d, t.tokens[i]].item()
            i = t.parents[i] - 1
        return s

    kept = sorted(score(i) for i in range(len(t)))
    every = []  # all prefixes of the full top-3 tree, by brute force
    for d in range(1, 5):
        for ranks in torch.cartesian_prod(*[torch.arange(3)] * d).view(-1, d).tolist():
            every.append(sum(top[k, r].item() for k, r in enumerate(ranks)))
    best = sorted(every)[-12:]
    assert kept == pytest.approx(best)


def test_tree_capacity_and_bad_arguments():
    assert capacity(3, 2) == 2 + 4 + 8
    lp = logprobs([{1: 0.6}])
    assert len(build_tree(lp, budget=50, topk=3)) == 3  # a 1-deep tree holds topk nodes
    with pytest.raises(ConfigError, match="tree_budget"):
        build_tree(lp, budget=0, topk=2)
    with pytest.raises(ConfigError, match="tree_topk"):
        build_tree(lp, budget=4, topk=7)


def test_tree_mask_is_ancestor_or_self():
    t = Tree(tokens=[1, 4, 2, 0, 4], parents=[0, 1, 0, 2, 3], depths=[1, 2, 1, 3, 2])
    m = tree_mask([t])[0].int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0],
                 [1, 1, 1, 0, 0, 0],
                 [1, 0, 0, 1, 0, 0],
                 [1, 1, 1, 0, 1, 0],
                 [1, 0, 0, 1, 0, 1]]


# ---- walk_tree: exact accept tables ----------------------------------------------------------
TREE = Tree(tokens=[1, 4, 2, 0, 4], parents=[0, 1, 0, 2, 3], depths=[1, 2, 1, 3, 2])


@pytest.mark.parametrize("choice,path,bonus", [
    ([1, 4, 0, 9, 9, 9], [1, 2, 4], 9),  # the top path, fully accepted, then the bonus
    ([2, 9, 9, 4, 9, 7], [3, 5], 7),  # the second choice at depth 1, then its child
    ([3, 9, 9, 9, 9, 9], [], 3),  # first-token miss: no node, the target's token is the bonus
    ([1, 5, 9, 9, 9, 9], [1], 5),  # depth-2 miss under the top node
    ([2, 9, 9, 6, 9, 9], [3], 6),  # miss under the second choice
])
def test_walk_tree_table(choice, path, bonus):
    assert walk_tree(TREE, choice) == (path, bonus)


# ---- the loop ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(qwen3_target):
    return qwen3_target, fitted_drafter(qwen3_target, num_layers=2, block_size=8)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("budget,topk", [(1, 1), (7, 2), (16, 4), (31, 3)])
def test_greedy_tree_identity(pair, batch, budget, topk):
    target, drafter = pair
    prompts = PROMPTS[:batch] if batch == 1 else PROMPTS[1:1 + batch]
    res = tree_generate(target, DFlashProposer(drafter), prompts, tree_budget=budget,
                        tree_topk=topk, block_size=8, max_new_tokens=40)
    assert res.tokens == greedy_reference(target, prompts, 40)
    m = res.metrics
    assert all(r.new_tokens == 40 for r in m.requests)
    assert m.tree["nodes_verified"] <= budget * sum(r.rounds for r in m.requests)
    assert sum(m.tree["accepted_depths"].values()) == m.rounds


def test_tree_accepts_at_least_the_linear_draft(pair):
    """The tree holds the linear draft's top-1 path, so its tau is at least the linear tau."""
    target, drafter = pair
    lin = speculative_generate(target, DFlashProposer(drafter), PROMPTS, block_size=8,
                               max_new_tokens=40)
    tree = tree_generate(target, DFlashProposer(drafter), PROMPTS, tree_budget=24, tree_topk=3,
                         block_size=8, max_new_tokens=40)
    assert tree.tokens == lin.tokens
    assert tree.metrics.tau >= lin.metrics.tau
    top1 = tree_generate(target, DFlashProposer(drafter), PROMPTS, tree_budget=7, tree_topk=1,
                         block_size=8, max_new_tokens=40)
    assert top1.metrics.tau == lin.metrics.tau  # a top-1 tree is the linear draft


def test_stop_token_mid_tree(pair):
    target, drafter = pair
    free = greedy_reference(target, PROMPTS[:3], 30)
    stop = free[0][10]
    ref = greedy_reference(target, PROMPTS[:3], 30, eos_token_id=stop)
    res = tree_generate(target, DFlashProposer(drafter), PROMPTS[:3], tree_budget=12,
                        tree_topk=3, block_size=8, max_new_tokens=30, stop_token_ids=(stop,))
    assert res.tokens == ref
    assert res.tokens[0][-1] == stop and res.metrics.requests[0].stop_reason == "stop"


class SecondChoiceOracle:
    """Drafts the target's true continuation as its SECOND most likely token at every depth
    (rank 0 is always a wrong token): a linear draft never lands, a tree with top-k >= 2 does."""

    layer_ids: tuple[int, ...] = ()

    def __init__(self, continuations, prompt_lens, vocab):
        self.continuations, self.lens, self.vocab = continuations, list(prompt_lens), vocab
        self.rows = list(range(len(continuations)))

    def start(self, runner, ids, features, positions, valid):
        self.rows = list(range(len(self.continuations)))

    def draft_logits(self, anchor_ids, anchor_pos, g):
        out = torch.full((len(self.rows), g, self.vocab), -10.0)
        for b, (row, pos) in enumerate(zip(self.rows, anchor_pos.tolist())):
            first = pos - self.lens[row] + 1
            ref = (self.continuations[row][first:first + g] + [0] * g)[:g]
            for d, t in enumerate(ref):
                out[b, d, (t + 1) % self.vocab] = 2.0  # wrong, most likely
                out[b, d, t] = 1.0  # right, second
        return out.to(anchor_ids.device)

    def observe(self, ids, features, positions, keep):
        pass

    def select_rows(self, rows):
        self.rows = [self.rows[i] for i in rows.tolist()]


def test_second_choice_oracle_is_accepted_through_the_tree(qwen3_target):
    prompts = PROMPTS[:3]
    max_new = 1 + 5 * 8
    ref = greedy_reference(qwen3_target, prompts, max_new)
    lens = [len(p) for p in prompts]
    linear = tree_generate(qwen3_target, SecondChoiceOracle(ref, lens, VOCAB), prompts,
                           tree_budget=7, tree_topk=1, block_size=8, max_new_tokens=max_new)
    tree = tree_generate(qwen3_target, SecondChoiceOracle(ref, lens, VOCAB), prompts,
                         tree_budget=64, tree_topk=2, block_size=8, max_new_tokens=max_new)
    assert linear.tokens == ref and tree.tokens == ref
    assert linear.metrics.tau == 1.0  # the top-1 path is always wrong
    assert tree.metrics.tau > 3.0  # deterministic: 3.08 with these logits


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=21),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=22),
])
def test_sampled_tree_matches_target(small, params):  # noqa: F811 (the fixture)
    target, drafter = small
    n = 20000
    res = tree_generate(target, DFlashProposer(drafter), [PROMPT] * n, tree_budget=6,
                        tree_topk=2, block_size=4, max_new_tokens=NEW, params=params)
    codes = torch.tensor([(t[0] * V + t[1]) * V + t[2] for t in res.tokens])
    counts = torch.bincount(codes, minlength=V ** NEW).double()
    assert 1.05 < res.metrics.tau < 3.0
    assert chi2_pvalue(counts, exact_distribution(target, params)) > 1e-3


@pytest.mark.parametrize("bug", ["top-path", "stale-residual"])
def test_sampled_tree_negative_control(small, monkeypatch, bug):  # noqa: F811
    """Two broken walks the same test must reject: one accepts the top path whatever the target
    says (samples from the drafter); one keeps the target's full p for every sibling instead of
    the residual after a rejection (over-weights tokens the drafter proposes twice over)."""
    import dflash_plugin.tree_generate as tg

    def accept_top_path(tree, p, q, generator):
        path, node = [], 0
        for i, parent in enumerate(tree.parents):
            if parent == node:
                path.append(i + 1)
                node = i + 1
        return path, int(torch.multinomial(p[node], 1, generator=generator))

    def stale_residual(tree, p, q, generator):  # each sibling tried against p itself
        kids: dict[int, list[int]] = {}
        for i, parent in enumerate(tree.parents):
            kids.setdefault(parent, []).append(i + 1)
        path, node = [], 0
        while True:
            r = p[node]
            for c in kids.get(node, []):
                x = tree.tokens[c - 1]
                s = q[tree.depths[c - 1] - 1]
                if s[x] > 0 and torch.rand((), generator=generator) * s[x] < r[x]:
                    path.append(c)
                    node = c
                    break
            else:
                return path, int(torch.multinomial(r, 1, generator=generator))

    monkeypatch.setattr(tg, "rejection_walk",
                        accept_top_path if bug == "top-path" else stale_residual)
    target, drafter = small
    params = SamplingParams(temperature=1.0, seed=23)
    res = tree_generate(target, DFlashProposer(drafter), [PROMPT] * 20000, tree_budget=6,
                        tree_topk=2, block_size=4, max_new_tokens=NEW, params=params)
    codes = torch.tensor([(t[0] * V + t[1]) * V + t[2] for t in res.tokens])
    counts = torch.bincount(codes, minlength=V ** NEW).double()
    assert chi2_pvalue(counts, exact_distribution(target, params)) < 1e-6


# ---- recursive rejection sampling at one node, exact -------------------------------------------
# Shape: three children of the root (ranks 0-2 at depth 1), two under the rank-0 child (depth 2);
# q at depth 1 has only 4 tokens in its support (rank 3+ would be dead), p depends on the path.
RRS_V = 6
RRS_Q = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0, 0.0],
                      [0.25, 0.25, 0.2, 0.1, 0.1, 0.1]])  # [depth, vocab]
RRS_P_ROOT = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.25, 0.15])
RRS_P_NEXT = torch.softmax(torch.arange(36.0).view(6, 6).sin() * 2, -1)  # [first token, vocab]
RRS_PARENTS, RRS_DEPTHS, RRS_RANKS = [0, 0, 0, 1, 1], [1, 1, 1, 2, 2], [0, 1, 2, 0, 1]


def rrs_trial_tensors(ranked: torch.Tensor):  # [trials, 2, 3] sampled tokens per depth, rank
    """Per trial: node tokens [trials, 5] and the target's p at each tree index [trials, 6, V]."""
    tokens = torch.stack([ranked[:, d - 1, r] for d, r in zip(RRS_DEPTHS, RRS_RANKS)], 1)
    p = torch.empty(len(ranked), 6, RRS_V)
    p[:, 0] = RRS_P_ROOT
    p[:, 1:] = RRS_P_NEXT[tokens]  # a depth-1 node's p follows its token; depth 2: unused
    return tokens, p


def rrs_check(first: torch.Tensor, second: torch.Tensor):
    """first ~ p at the root; second | first = x (a kept depth-1 node) ~ p after x."""
    assert chi2_pvalue(torch.bincount(first, minlength=RRS_V).double(),
                       RRS_P_ROOT.double()) > 1e-3
    for x in range(RRS_V):
        sel = second[(first == x) & (second >= 0)]
        if len(sel) > 200:
            assert chi2_pvalue(torch.bincount(sel, minlength=RRS_V).double(),
                               RRS_P_NEXT[x].double()) > 1e-3, x
    kept = (second >= 0).float().mean().item()
    assert 0.3 < kept < 1.0, kept  # the children are kept often, not always


def test_sample_ranks_is_a_sample_without_replacement():
    gen = torch.Generator().manual_seed(0)
    ranked = sample_ranks(RRS_Q[None].expand(20000, 2, RRS_V), 3, gen)  # [trials, 2, 3]
    assert (ranked[:, 0, :3] < 4).all()  # q's support first
    for d in range(2):
        r = ranked[:, d]
        assert (r[:, 0] != r[:, 1]).all() and (r[:, 1] != r[:, 2]).all()
        assert chi2_pvalue(torch.bincount(r[:, 0], minlength=RRS_V).double(),
                           RRS_Q[d].double()) > 1e-3
        q2 = RRS_Q[d][None].expand(RRS_V, RRS_V).clone().fill_diagonal_(0)  # second | first
        q2 = q2 / q2.sum(-1, keepdim=True)
        exp = (RRS_Q[d][:, None] * q2).flatten()
        got = torch.bincount(r[:, 0] * RRS_V + r[:, 1], minlength=RRS_V ** 2).double()
        assert chi2_pvalue(got, exp.double()) > 1e-3


def test_rejection_walk_is_exact_at_a_node():
    gen = torch.Generator().manual_seed(1)
    trials = 12000
    ranked = sample_ranks(RRS_Q[None].expand(trials, 2, RRS_V), 3, gen)
    tokens, p = rrs_trial_tensors(ranked)
    first, second = torch.empty(trials, dtype=torch.long), torch.full((trials,), -1)
    for t in range(trials):
        tree = Tree(tokens[t].tolist(), RRS_PARENTS, RRS_DEPTHS)
        path, bonus = rejection_walk(tree, p[t], RRS_Q, gen)
        out = [tree.tokens[i - 1] for i in path] + [bonus]
        first[t] = out[0]
        if len(out) > 1:
            second[t] = out[1]
    rrs_check(first, second)


def test_bad_tree_arguments(pair):
    target, drafter = pair
    with pytest.raises(ConfigError, match="tree_budget"):
        tree_generate(target, DFlashProposer(drafter), PROMPTS[:1], tree_budget=0)
    with pytest.raises(ConfigError, match="tree_topk"):
        tree_generate(target, DFlashProposer(drafter), PROMPTS[:1], tree_budget=4,
                      tree_topk=VOCAB + 1)
    assert math.isfinite(capacity(15, 4))
