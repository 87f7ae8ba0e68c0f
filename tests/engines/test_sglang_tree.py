"""DFLASH_TREE for SGLang, in this environment (no SGLang): the tree-verify tensors of
`dflash_plugin/engines/sglang_tree_input.py` against brute-force loops, and a walk of their
retrieve links (SGLang's greedy rule) against `tree.walk_tree`; the server-arg rules of
`sglang_tree_algo.py` that need no SGLang. The same checks against SGLang's own verify kernel,
registration and ServerArgs run in `sglang_env/checks_tree.py` (the worker's conformance with
0.5.16: `checks_tree_worker.py`, its host plan `checks_tree_plan.py`, its greedy acceptance in
one graph `checks_tree_accept.py`, at T > 0 `checks_tree_sample.py`; DFLASH_ADAPTIVE:
`checks_adaptive.py`, `checks_adaptive_defer.py`, `checks_adaptive_attention.py`,
`checks_adaptive_prefill.py`; both workers' decode-step preparation `checks_decode_prep.py` and
admission `checks_admission.py`):
in the 0.5.23 env through `test_sglang.py` (its `checks*.py` glob), in the 0.5.16 env here
(`test_in_sglang_0_5_16`).
"""

import sys
from pathlib import Path

import pytest
import torch

from dflash_plugin.errors import ConfigError
from dflash_plugin.fast.tree_build import build_tree
from dflash_plugin.tree import Tree, walk_tree
from tests.engines.oldest_sglang import run_checks

ROOT = Path(__file__).resolve().parents[2]
CHECKS = [ROOT / "tests" / "engines" / "sglang_env" / f"{name}.py"
          for name in ("checks_tree", "checks_tree_worker", "checks_tree_plan",
                       "checks_tree_fa3", "checks_tree_accept", "checks_tree_sample",
                       "checks_adaptive", "checks_adaptive_defer", "checks_adaptive_attention",
                       "checks_adaptive_prefill", "checks_decode_prep",
                       "checks_admission")]
FIX = ROOT / "examples" / "fixtures"


def random_trees(bs: int, g: int, k: int, n: int, vocab: int, seed: int):
    """`bs` trees of `n` nodes from random drafter marginals (the fast builder)."""
    gen = torch.Generator().manual_seed(seed)
    lp = torch.randn(bs, g, vocab, generator=gen).log_softmax(-1)
    top_lp, top_ids = lp.topk(k, dim=-1)
    return build_tree(top_lp, top_ids, n)


def targets_for(tokens, parents, vocab: int, seed: int, follow: float = 0.75):
    """The target's choice at every tree index: mostly one of the node's children's tokens
    (so paths get accepted), else a random token."""
    gen = torch.Generator().manual_seed(seed)
    bs, n = tokens.shape
    choice = torch.randint(0, vocab, (bs, n + 1), generator=gen)
    for b in range(bs):
        kids = {}
        for i in range(n):
            kids.setdefault(int(parents[b, i]), []).append(int(tokens[b, i]))
        for node, toks in kids.items():
            if torch.rand((), generator=gen) < follow:
                choice[b, node] = toks[int(torch.randint(len(toks), (), generator=gen))]
    return choice


def brute(tokens, parents, depths, root, seq_lens):
    """Loop reference of every tensor, request by request."""
    bs, n = tokens.shape
    w = n + 1
    draft, pos, mask, nxt, sib = [], [], [], [], []
    for b in range(bs):
        par = [0] + parents[b].tolist()
        dep = [0] + depths[b].tolist()
        draft += [int(root[b])] + tokens[b].tolist()
        pos += [int(seq_lens[b]) + d for d in dep]
        for i in range(w):
            anc, j = {i}, i
            while j:
                j = par[j]
                anc.add(j)
            mask += [True] * int(seq_lens[b]) + [c in anc for c in range(w)]
        kids = [[j for j in range(1, w) if par[j] == i] for i in range(w)]
        nxt.append([min(c) if c else -1 for c in kids])
        s = [-1] * w
        for c in kids:
            for a, z in zip(c, c[1:]):
                s[a] = z
        sib.append(s)
    return draft, pos, mask, nxt, sib


def walk_links(t, choice):
    """SGLang's greedy tree walk (eagle `verify_tree_greedy` semantics) over the retrieve
    links: from the root, scan first child then siblings for the target's token there."""
    bs, w = t.retrieve_index.shape
    cand = t.draft_token.view(bs, w)
    out = []
    for b in range(bs):
        node, path = 0, []
        for _ in range(1, t.max_tree_depth):
            c = int(t.retrieve_next_token[b, node])
            while c != -1 and int(cand[b, c]) != int(choice[b, node]):
                c = int(t.retrieve_next_sibling[b, c])
            if c == -1:
                break
            path.append(c)
            node = c
        out.append((path, int(choice[b, node])))
    return out


CASES = [(1, 4, 2, 3, 11), (7, 6, 3, 17, 111), (3, 15, 4, 63, 8193), (2, 3, 1, 3, 29),
         (4, 15, 8, 8, 151)]


@pytest.mark.parametrize("bs,g,k,n,vocab", CASES)
def test_tree_tensors_equal_brute_force(bs, g, k, n, vocab):
    from dflash_plugin.engines.sglang_tree_input import build_verify_tensors, check_tree_order

    tokens, parents, depths = random_trees(bs, g, k, n, vocab, seed=bs * 100 + n)
    check_tree_order(parents)
    root = torch.randint(0, vocab, (bs,))
    seq_lens = torch.randint(1, 40, (bs,))
    t = build_verify_tensors(tokens, parents, depths, root, seq_lens, int(seq_lens.sum()), g)
    draft, pos, mask, nxt, sib = brute(tokens, parents, depths, root, seq_lens)
    assert t.draft_token_num == n + 1 and t.max_tree_depth == g + 1
    assert t.draft_token.tolist() == draft
    assert t.positions.tolist() == pos
    assert t.custom_mask.dtype == torch.bool and t.custom_mask.tolist() == mask
    assert t.retrieve_next_token.tolist() == nxt
    assert t.retrieve_next_sibling.tolist() == sib
    assert t.retrieve_index.tolist() == [[b * (n + 1) + i for i in range(n + 1)]
                                         for b in range(bs)]
    # into a larger (graph) buffer: the same prefix, filled whatever was there before
    buf = torch.zeros(len(mask) + 13, dtype=torch.bool)
    t2 = build_verify_tensors(tokens, parents, depths, root, seq_lens, int(seq_lens.sum()), g,
                              mask_out=buf)
    assert t2.custom_mask.data_ptr() == buf.data_ptr() and buf[:len(mask)].tolist() == mask
    # SGLang 0.5.16's Triton backend hands out a uint8 graph mask buffer
    buf8 = torch.full((len(mask) + 5,), 7, dtype=torch.uint8)
    t3 = build_verify_tensors(tokens, parents, depths, root, seq_lens, int(seq_lens.sum()), g,
                              mask_out=buf8)
    assert t3.custom_mask.data_ptr() == buf8.data_ptr()
    assert buf8[:len(mask)].tolist() == [int(m) for m in mask]
    # a buffer too small (a batch past the backend's graph sizes): a mask of its own
    small = torch.zeros(len(mask) - 1, dtype=torch.bool)
    t4 = build_verify_tensors(tokens, parents, depths, root, seq_lens, int(seq_lens.sum()), g,
                              mask_out=small)
    assert t4.custom_mask.data_ptr() != small.data_ptr() and t4.custom_mask.tolist() == mask
    assert not small.any()


@pytest.mark.parametrize("bs,g,k,n,vocab", CASES)
def test_greedy_walk_over_links_is_walk_tree(bs, g, k, n, vocab):
    from dflash_plugin.engines.sglang_tree_input import build_verify_tensors

    tokens, parents, depths = random_trees(bs, g, k, n, vocab, seed=7 + n)
    seq_lens = torch.full((bs,), 5)
    t = build_verify_tensors(tokens, parents, depths, torch.zeros(bs, dtype=torch.long),
                             seq_lens, 5 * bs, g)
    for seed in range(5):
        choice = targets_for(tokens, parents, vocab, seed)
        got = walk_links(t, choice)
        for b in range(bs):
            tree = Tree(tokens[b].tolist(), parents[b].tolist(), depths[b].tolist())
            assert got[b] == walk_tree(tree, choice[b].tolist()), (b, seed)


def test_hand_built_cases():
    """Root -> {a: 10, b: 11}, a -> {c: 12}, b -> {d: 13}: table of target choices."""
    from dflash_plugin.engines.sglang_tree_input import build_verify_tensors

    tokens = torch.tensor([[10, 11, 12, 13]])
    parents = torch.tensor([[0, 0, 1, 2]])
    depths = torch.tensor([[1, 1, 2, 2]])
    t = build_verify_tensors(tokens, parents, depths, torch.tensor([9]), torch.tensor([3]), 3, 2)
    assert t.retrieve_next_token.tolist() == [[1, 3, 4, -1, -1]]
    assert t.retrieve_next_sibling.tolist() == [[-1, 2, -1, -1, -1]]
    table = [  # choice at tree index 0..4 -> (accepted tree indices, bonus)
        ([10, 12, 0, 7, 0], ([1, 3], 7)),  # all of a's branch accepted
        ([5, 0, 0, 0, 0], ([], 5)),  # first depth rejected: bonus only
        ([11, 0, 13, 0, 8], ([2, 4], 8)),  # the second sibling is the target's choice
        ([11, 0, 6, 0, 0], ([2], 6)),  # second sibling, then its child rejected
    ]
    for choice, want in table:
        assert walk_links(t, torch.tensor([choice])) == [want]


def test_no_host_sync_shapes_only_from_host_ints():
    """Sizes come from host ints only: the build runs on 'meta' tensors (no values)."""
    from dflash_plugin.engines.sglang_tree_input import build_verify_tensors

    m = dict(device="meta", dtype=torch.long)
    t = build_verify_tensors(torch.empty(3, 8, **m), torch.empty(3, 8, **m),
                             torch.empty(3, 8, **m), torch.empty(3, **m), torch.empty(3, **m),
                             100, 5)
    assert t.custom_mask.shape == (9 * 100 + 3 * 81,) and t.retrieve_index.shape == (3, 9)


@pytest.mark.parametrize("fields,message", [
    (dict(num_draft_tokens=None), "speculative_num_draft_tokens: required"),
    (dict(num_draft_tokens=1), r"speculative_num_draft_tokens: must be in \[2, 512\]"),
    (dict(num_draft_tokens=600), r"speculative_num_draft_tokens: must be in \[2, 512\]"),
    (dict(topk=0), r"speculative_eagle_topk: must be in \[1, 16\]"),
    (dict(topk=17), r"speculative_eagle_topk: must be in \[1, 16\]"),
    (dict(block_size=1), r"speculative_dflash_block_size: must be >= 2"),
    (dict(num_draft_tokens=200, block_size=4, topk=3),
     r"node budget 199 exceeds the full top-3 tree of 3 levels \(39 nodes\)"),
    (dict(device="cpu"), "device: DFLASH_TREE needs a CUDA device"),
])
def test_tree_arg_rules(fields, message):
    from dflash_plugin.engines.sglang_tree_algo import TreeArgs, check_tree_args

    base = dict(num_draft_tokens=17, topk=4, block_size=16, device="cuda")
    with pytest.raises(ConfigError, match=message):
        check_tree_args(TreeArgs(**{**base, **fields}))
    got = check_tree_args(TreeArgs(**base))
    assert (got.budget, got.topk, got.depth, got.width) == (16, 4, 15, 17)
    assert check_tree_args(TreeArgs(**{**base, "topk": None})).topk == 8  # default min(8, N)


def test_fa3_target_backend_needs_topk_above_one():
    """fa3 verifies a tree only through its top-K > 1 cascade; with top-K 1 it would treat the
    tree as a causal chain. The check reads the built backend (and a hybrid one's parts); the
    classes here only carry the name and `topk` it reads (no GPU backend builds on CPU)."""
    from dflash_plugin.engines.sglang_tree_algo import check_target_backend

    fa3 = type("FlashAttentionBackend", (), {})
    flashinfer = type("FlashInferAttnBackend", (), {})
    hybrid = type("HybridAttnBackend", (), {})

    def make(cls, **kw):
        be = cls()
        be.__dict__.update(kw)
        return be

    check_target_backend(make(fa3, topk=4))
    check_target_backend(make(flashinfer, topk=1))
    for bad in (make(fa3, topk=1), make(fa3),
                make(hybrid, decode_backend=make(fa3, topk=1), prefill_backend=make(flashinfer))):
        with pytest.raises(ConfigError, match=r"attention_backend: DFLASH_TREE's target runs "
                                              r"fa3 with top-K (1|None)"):
            check_target_backend(bad)


def test_adapters_import_without_sglang():
    for mod in ("sglang_tree_input", "sglang_tree_algo", "sglang_tree_worker"):
        __import__(f"dflash_plugin.engines.{mod}")
    assert "sglang" not in sys.modules


@pytest.fixture(scope="module")
def legacy_results(tmp_path_factory):
    return run_checks(CHECKS, tmp_path_factory.mktemp("legacy-tree"), timeout=1200)


def test_in_sglang_0_5_16(legacy_results):
    """checks_tree.py, checks_tree_worker.py and checks_adaptive.py against sglang==0.5.16,
    one subprocess: none may fail (0.5.23-only checks skip)."""
    assert legacy_results, "no checks ran"
    failed = {k: v[1] for k, v in legacy_results.items() if v[0] == "failed"}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
