"""Tree rounds of the fast runtime (`dflash_plugin.fast.tree_loop`) on CPU, fp32, SDPA, no graphs.

The device tree build equals the reference `tree.build_tree` as a set of prefixes; the block mask
of the attention plan equals a hand-built one (and the hand-computed attention); greedy tree
decoding is token-identical to plain decoding and commits what the reference `tree_generate`
commits, round by round (batch 1 and 4, ragged, stop tokens mid-tree); an oracle whose top-1 draft
is always wrong but whose second choice is right is accepted through the tree. Sampled: the
device walk is exact at a node (the reference test's distributions) and the whole sampled loop
follows the target's distribution (chi-square over every 3-token continuation).
"""

import os

import pytest
import torch

from dflash_plugin.errors import ConfigError
from dflash_plugin.fast import build_decoder
from dflash_plugin.fast.attention import attend, plan
from dflash_plugin.fast.tree_build import (
    ancestor_mask,
    build_tree,
    child_table,
    greedy_path,
    rejection_path,
)
from dflash_plugin.fast.tree_loop import TreeDecoder, tree_generate_fast
from dflash_plugin.proposers import DFlashProposer
from dflash_plugin.sampling import SamplingParams
from dflash_plugin.tree import Tree, capacity, tree_mask, walk_tree
from dflash_plugin.tree import build_tree as reference_build
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

PROMPTS = [[5, 17, 29, 41], [9, 8, 7, 6, 5, 4], [11, 12], [20, 30, 40, 50, 60, 70, 80]]


def prefixes(tokens, parents) -> set[tuple[int, ...]]:
    """Every node as its token path from the root (the tree as a set of prefixes)."""
    out = set()
    for i in range(len(tokens)):
        path, j = [], i + 1
        while j:
            path.append(tokens[j - 1])
            j = parents[j - 1]
        out.add(tuple(reversed(path)))
    return out


# ---- the device tree build -------------------------------------------------------------------
def test_device_build_equals_reference_build():
    """Random log-probs (tie-free), 200 seeds: g 1..7, topk 1..4, odd budgets and
    budget == capacity; the same prefixes, parents before children, depths consistent, and the
    ancestor mask equals `tree.tree_mask`."""
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        g, k = 1 + seed % 7, 1 + (seed // 7) % 4
        cap = capacity(g, k)
        odd = 1 + 2 * int(torch.randint(0, (min(cap, 80) + 1) // 2, (1,), generator=gen))
        budget = cap if seed % 5 == 0 and cap <= 120 else min(odd, cap)
        lp = (torch.randn(3, g, 13, generator=gen) * 2).log_softmax(-1)
        tok, par, dep = build_tree(*lp.topk(k, -1), budget)
        assert tok.shape == par.shape == dep.shape == (3, budget)
        for r in range(3):
            ref = reference_build(lp[r], budget, k)
            t, p, d = tok[r].tolist(), par[r].tolist(), dep[r].tolist()
            assert prefixes(t, p) == prefixes(ref.tokens, ref.parents), (seed, r)
            assert all(q < i + 1 for i, q in enumerate(p))
            assert all(d[i] == (d[q - 1] if q else 0) + 1 for i, q in enumerate(p))
            assert d == sorted(d)  # by depth (then score)
            full = torch.tensor([0] + p)[None]
            assert torch.equal(ancestor_mask(full, max(d))[0], tree_mask([Tree(t, p, d)])[0])


def test_device_build_budget_over_capacity_is_an_error():
    lp = torch.zeros(1, 2, 5).log_softmax(-1)
    with pytest.raises(ConfigError, match="tree_budget"):
        build_tree(*lp.topk(2, -1), capacity(2, 2) + 1)


TREE = Tree(tokens=[1, 4, 2, 0, 4], parents=[0, 1, 0, 2, 3], depths=[1, 2, 1, 3, 2])


@pytest.mark.parametrize("choice,path,bonus", [
    ([1, 4, 0, 9, 9, 9], [1, 2, 4], 9),  # the top path, fully accepted, then the bonus
    ([2, 9, 9, 4, 9, 7], [3, 5], 7),  # the second choice at depth 1, then its child
    ([3, 9, 9, 9, 9, 9], [], 3),  # first-token miss
    ([1, 5, 9, 9, 9, 9], [1], 5),  # depth-2 miss under the top node
    ([2, 9, 9, 6, 9, 9], [3], 6),  # miss under the second choice
])
def test_greedy_path_table(choice, path, bonus):
    """The vectorised walk equals `tree.walk_tree` (the reference's accept table)."""
    assert walk_tree(TREE, choice) == (path, bonus)
    tokens = torch.tensor([[7] + TREE.tokens])
    parents, depths = torch.tensor([[0] + TREE.parents]), torch.tensor([[0] + TREE.depths])
    got, acc = greedy_path(tokens, parents, depths, torch.tensor([choice]), 3)
    assert acc.item() == len(path) and got[0].tolist() == [0] + path + [0] * (3 - len(path))
    assert choice[got[0, len(path)]] == bonus


# ---- the block mask of the attention plan ----------------------------------------------------
def _tree_inputs(seed=0, b=3, nb=7, L=32, kvh=2, groups=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    lp = torch.randn(b, 3, 11, generator=gen).log_softmax(-1)
    _, par, _ = build_tree(*lp.topk(3, -1), nb - 1)
    anc = ancestor_mask(torch.cat([torch.zeros(b, 1, dtype=torch.long), par], 1), 3)
    lengths = torch.tensor([5, 1, 20])[:b]
    k, v = (torch.randn(b, kvh, L, d, generator=gen) for _ in range(2))
    q = torch.randn(b, kvh * groups, nb, d, generator=gen)
    return anc, lengths, q, k, v, groups


def test_plan_block_mask_equals_hand_built():
    anc, lengths, q, k, v, groups = _tree_inputs()
    b, nb, L = anc.shape[0], anc.shape[1], k.shape[2]
    p = plan("sdpa", lengths[:, None], torch.arange(L), groups, block_mask=anc)
    want = torch.zeros(b, nb, L, dtype=torch.bool)
    for r in range(b):
        want[r, :, :lengths[r]] = True
        want[r, :, lengths[r]:lengths[r] + nb] = anc[r]
    assert torch.equal(p.mask[:, 0, :nb], want)  # group 0's rows
    assert torch.equal(p.mask[:, 0, nb:], want)  # group 1's rows
    out = attend(p, q, k, v).view(b, nb, -1, q.shape[-1]).transpose(1, 2)  # [b, heads, nb, d]
    for r in range(b):
        for h in range(q.shape[1]):
            kh, vh = k[r, h // groups], v[r, h // groups]
            s = (q[r, h] @ kh.T) * q.shape[-1] ** -0.5
            ref = s.masked_fill(~want[r], float("-inf")).softmax(-1) @ vh
            torch.testing.assert_close(out[r, h], ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="visible"):
        plan("sdpa", lengths[:, None].expand(b, nb), torch.arange(L), groups, block_mask=anc)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors through the Triton interpreter (tests/kernels/"
                           "test_interpreter.py runs it); on CUDA: test_tree_cuda_graphs_*")
def test_plan_block_mask_triton_equals_sdpa():
    """The triton plan runs `branch_attention` with the tree as its blk_mask over the new K/V
    (prefix from the cache up to the row's length): same output as the SDPA plan."""
    anc, lengths, q, k, v, groups = _tree_inputs(seed=1, L=64)
    nb = anc.shape[1]
    kvh, d = k.shape[1], k.shape[-1]  # views whose strides differ between K and V, as the
    k_new = torch.randn(q.shape[0], nb, 3 * kvh, d)[:, :, kvh:2 * kvh]  # forward's QK / V are
    v_new = torch.randn(q.shape[0], nb, 2 * kvh, d)[:, :, :kvh]
    for r in range(q.shape[0]):  # the forward writes its K/V at slots length + tree index
        k[r, :, lengths[r]:lengths[r] + nb] = k_new[r].transpose(0, 1)
        v[r, :, lengths[r]:lengths[r] + nb] = v_new[r].transpose(0, 1)
    ref = attend(plan("sdpa", lengths[:, None], torch.arange(64), groups, block_mask=anc), q, k, v)
    for backend in ("triton", "triton-invariant"):
        p = plan(backend, lengths[:, None], torch.arange(64), groups, block_mask=anc)
        got = attend(p, q, k, v, k_new, v_new)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


# ---- the sampled walk on the device --------------------------------------------------------------
def test_child_table_lists_children_in_rank_order():
    parents = torch.tensor([[0, 0, 0, 0, 1, 1, 4], [0, 0, 1, 1, 1, 2, 0]])
    kid = child_table(parents, 3)
    assert kid[0, 0].tolist() == [1, 2, 3] and kid[0, 1].tolist() == [4, 5, 0]
    assert kid[0, 4].tolist() == [6, 0, 0] and kid[0, 2].tolist() == [0, 0, 0]
    assert kid[1, 0].tolist() == [1, 6, 0] and kid[1, 1].tolist() == [2, 3, 4]
    assert kid[1, 2].tolist() == [5, 0, 0]


def test_rejection_path_is_exact_at_a_node():
    """The reference test's tree and distributions (tests/dflash/test_tree.py), every trial a
    row of one batched call: the first token follows p at the root, the second p after it."""
    from dflash_plugin.tree import sample_ranks
    from tests.dflash.test_tree import (
        RRS_PARENTS,
        RRS_Q,
        RRS_V,
        rrs_check,
        rrs_trial_tensors,
    )
    gen = torch.Generator().manual_seed(2)
    trials = 40000
    ranked = sample_ranks(RRS_Q[None].expand(trials, 2, RRS_V), 3, gen)
    tokens, p = rrs_trial_tensors(ranked)
    ids = torch.cat([torch.zeros(trials, 1, dtype=torch.long), tokens], 1)  # [trials, 6]
    parents = torch.tensor([0] + RRS_PARENTS).expand(trials, 6)
    q = RRS_Q[None].expand(trials, 2, RRS_V)
    path, acc, bonus = rejection_path(ids, parents, p.log(), q, SamplingParams(1.0), 2, 3, gen)
    first = torch.where(acc >= 1, ids.gather(1, path[:, 1:2])[:, 0], bonus)
    second = torch.where(acc >= 2, ids.gather(1, path[:, 2:3])[:, 0],
                         torch.where(acc == 1, bonus, -1))
    assert (path[:, 1] <= 3).all() and ((path[:, 2] == 0) | (path[:, 2] >= 4)).all()
    rrs_check(first, second)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=31),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=32),
])
def test_sampled_fast_tree_matches_target(small, params):  # noqa: F811 (the fixture)
    """The sampled fast tree loop end to end (first token sampled in the prefill, drafts from q,
    the device walk, compaction): every 3-token continuation at the exact target frequency
    (chi-square, as tests/dflash/test_sampling.py)."""
    _sampled_fast_tree_check(*small, params, graphs=False)


def _sampled_fast_tree_check(target, drafter, params, graphs: bool):
    n = 20000
    dec = build_decoder(target, drafter, batch=n, max_len=32, max_block=4, graphs=graphs)
    res = tree_generate_fast(dec, [PROMPT] * n, budget=6, topk=2, block_size=4,
                             max_new_tokens=NEW, params=params)
    codes = torch.tensor([(t[0] * V + t[1]) * V + t[2] for t in res.tokens])
    counts = torch.bincount(codes, minlength=V ** NEW).double()
    assert 1.05 < res.metrics.tau < 3.0
    assert chi2_pvalue(counts, exact_distribution(target.cpu(), params)) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampled_fast_tree_under_cuda_graphs(small):  # noqa: F811
    """The same check on CUDA with the round steps captured (random numbers from the default
    generator inside the graphs), fp32."""
    import copy
    target, drafter = (copy.deepcopy(m).cuda() for m in small)
    torch.manual_seed(41)
    _sampled_fast_tree_check(target, drafter, SamplingParams(temperature=1.0), graphs=True)


def test_sampled_fast_tree_refuses_other_params(pair):
    target, drafter = pair
    dec = build_decoder(target, drafter, batch=1, max_len=64, max_block=8, graphs=False)
    tdec = TreeDecoder(dec, 4, 2, params=SamplingParams(temperature=1.0, seed=0))
    with pytest.raises(ConfigError, match="params"):
        tree_generate_fast(tdec, [[5, 6]], max_new_tokens=4, params=SamplingParams())


# ---- the loop ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(qwen3_target):
    return qwen3_target, fitted_drafter(qwen3_target, num_layers=1, block_size=8)


def _rounds(res):
    return [r.round_tokens for r in res.metrics.requests]


@pytest.mark.parametrize("batch,budget,topk", [(1, 16, 4), (4, 7, 2)])
def test_tree_identity_and_reference_rounds(pair, batch, budget, topk):
    """Token identity with plain decoding and the reference loop's commits per round (same
    budget / topk / block), batch 1 and 4 ragged rows, over a reused TreeDecoder."""
    target, drafter = pair
    prompts, new = PROMPTS[:batch], 40 if batch == 1 else 24
    dec = build_decoder(target, drafter, batch=batch, max_len=96, max_block=8, graphs=False)
    tdec = TreeDecoder(dec, budget, topk)
    ref = tree_generate(target, DFlashProposer(drafter), prompts, tree_budget=budget,
                        tree_topk=topk, block_size=8, max_new_tokens=new)
    for _ in range(2 if batch == 1 else 1):  # reuse: the state is reset by the prefill
        res = tree_generate_fast(tdec, prompts, max_new_tokens=new)
        assert res.tokens == ref.tokens == greedy_reference(target, prompts, new)
        assert _rounds(res) == _rounds(ref)
        assert res.metrics.tree["accepted_depths"] == ref.metrics.tree["accepted_depths"]
        assert res.metrics.tree["nodes_verified"] == ref.metrics.tree["nodes_verified"]
    assert max(_rounds(res)[0]) > 2  # multi-token commits through the tree


def test_tree_stop_token_mid_tree_and_padding_rows(pair):
    target, drafter = pair
    prompts = PROMPTS[:3]
    stop = greedy_reference(target, prompts[:1], 30)[0][10]
    dec = build_decoder(target, drafter, batch=4, max_len=96, max_block=8, graphs=False)
    res = tree_generate_fast(dec, prompts, budget=12, topk=3, max_new_tokens=30,
                             stop_token_ids=(stop,))
    assert res.tokens == greedy_reference(target, prompts, 30, eos_token_id=stop)
    assert res.tokens[0][-1] == stop and res.metrics.requests[0].stop_reason == "stop"
    assert sum(res.metrics.tree["accepted_depths"].values()) == res.metrics.rounds


class DeviceSecondChoiceOracle:
    """The fast runtime's draft_logits hook: the target's true continuation as the SECOND most
    likely token at every depth (rank 0 is always wrong); reads the row's progress from the
    decoder's `out_len` on the device (no host sync)."""

    def __init__(self, dec, continuations):
        self.dec = dec
        width = max(map(len, continuations)) + 16
        rows = [c + [0] * (width - len(c)) for c in continuations]
        rows += [rows[0]] * (dec.batch - len(rows))
        self.cont = torch.tensor(rows)

    def __call__(self, g):  # -> [batch, g, vocab]
        at = (self.dec.out_len[:, None] + torch.arange(g)).clamp_max(self.cont.shape[1] - 1)
        right = self.cont.gather(1, at)
        out = torch.full((self.dec.batch, g, VOCAB), -10.0)
        out.scatter_(2, ((right + 1) % VOCAB)[..., None], 2.0)  # wrong, most likely
        return out.scatter_(2, right[..., None], 1.0)  # right, second


def test_second_choice_oracle_is_accepted_through_the_tree(qwen3_target):
    prompts, new = PROMPTS[:3], 1 + 5 * 8
    ref = greedy_reference(qwen3_target, prompts, new)
    dec = build_decoder(qwen3_target, None, batch=3, max_len=128, max_block=8, graphs=False)
    oracle = DeviceSecondChoiceOracle(dec, ref)
    linear = tree_generate_fast(TreeDecoder(dec, 7, 1, draft_logits=oracle), prompts,
                                max_new_tokens=new)
    tree = tree_generate_fast(TreeDecoder(dec, 64, 2, draft_logits=oracle), prompts,
                              max_new_tokens=new)
    assert linear.tokens == ref and tree.tokens == ref
    assert linear.metrics.tau == 1.0  # the top-1 path is always wrong
    assert tree.metrics.tau > 3.0  # the reference loop's oracle test: 3.08


def test_bad_tree_arguments(pair):
    target, drafter = pair
    dec = build_decoder(target, drafter, batch=1, max_len=64, max_block=8, graphs=False)
    with pytest.raises(ConfigError, match="tree_budget"):
        TreeDecoder(dec, 0, 2)
    with pytest.raises(ConfigError, match="tree_topk"):
        TreeDecoder(dec, 4, VOCAB + 1)
    with pytest.raises(ConfigError, match="block_size"):
        TreeDecoder(dec, 4, 2, block_size=9)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        tree_generate_fast(dec, [[5, 6]], budget=32, topk=4, max_new_tokens=40)
    TreeDecoder(dec, 31, 2).warmup()  # the widest prefill leaves no room for 31 scratch slots
    plain = build_decoder(target, None, batch=1, max_len=64, max_block=8, graphs=False)
    with pytest.raises(ConfigError, match="drafter"):
        TreeDecoder(plain, 4, 2)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors through the Triton interpreter (tests/kernels/"
                           "test_interpreter.py runs it); on CUDA: test_tree_cuda_graphs_*")
def test_tree_loop_triton_backend(qwen3_target):
    """The whole tree loop on the Triton attention backend (block mask through blk_mask)."""
    from dflash_plugin.checkpoint import config_for_target, init_drafter
    cfg = config_for_target(qwen3_target.config, num_layers=1, block_size=8, mask_token_id=3)
    drafter = init_drafter(cfg, seed=0).eval()  # acceptance is beside the point here
    prompts = PROMPTS[:2]
    dec = build_decoder(qwen3_target, drafter, batch=2, max_len=64, max_block=8, graphs=False,
                        attention="triton")
    res = tree_generate_fast(dec, prompts, budget=5, topk=3, max_new_tokens=8)
    assert res.tokens == greedy_reference(qwen3_target, prompts, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_tree_cuda_graphs_match_greedy(pair, attention):
    """CUDA graphs per (budget, topk, g): captured on the first pass, replayed on the second
    and after `warmup`; same tokens as plain decoding and the same commits as eager."""
    from tests.conftest import tiny_target
    target, drafter = pair
    expected = greedy_reference(target, PROMPTS, 40)
    tgt, drf = tiny_target().cuda(), drafter.to("cuda")
    try:
        rounds = None
        for graphs in (False, True):
            dec = build_decoder(tgt, drf, batch=4, max_len=128, max_block=8, graphs=graphs,
                                attention=attention)
            tdec = TreeDecoder(dec, 24, 3)
            if graphs:
                tdec.warmup()
            for _ in range(2):
                res = tree_generate_fast(tdec, PROMPTS, max_new_tokens=40, profile=graphs)
                assert res.tokens == expected
                rounds = rounds or _rounds(res)
                assert _rounds(res) == rounds
    finally:
        drafter.to("cpu")
