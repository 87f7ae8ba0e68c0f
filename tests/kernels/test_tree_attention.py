"""Tree verification through the paged branch-attention kernel: one branch per row whose queries
are [anchor + tree nodes] and whose block mask is the tree's ancestor-or-self mask
(`dflash_plugin.tree.tree_mask`), over a paged committed prefix. Kernel vs the torch reference
with odd node counts, GQA, pages of 16 and 64, NaN-poisoned outputs and unreferenced pages (see
test_attention.py); tolerance fp32 2e-5."""

import pytest
import torch

from dflash_plugin.tree import build_tree, tree_mask
from tests.kernels._util import DEV, direct, poison_empty
from tests.kernels.test_attention import make_case, ref_of

pytestmark = direct
attn = pytest.importorskip("specdec_kernels.attention")


def trees(rows: int, depth: int, budget: int, topk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lps = torch.randn(rows, depth, 50, generator=g).log_softmax(-1)
    return [build_tree(lp, budget, topk) for lp in lps]


@pytest.mark.parametrize("budget,topk,heads,kv_heads,page,lens", [
    (7, 2, 8, 2, 16, [37, 5]),  # odd node count, GQA 4
    (15, 3, 4, 4, 64, [70, 129, 1]),  # MHA, pages of 64, a 1-token prefix
    (32, 4, 8, 1, 16, [16, 48]),  # 33 queries (anchor + 32 nodes), GQA 8, whole pages
])
def test_tree_mask_matches_reference(monkeypatch, budget, topk, heads, kv_heads, page, lens):
    poison_empty(monkeypatch, attn)
    rows, n = len(lens), budget + 1
    ts = trees(rows, depth=6, budget=budget, topk=topk, seed=budget)
    assert all(len(t) == budget for t in ts)
    case = make_case(rows, 1, n, n, heads, kv_heads, 64, page, lens, seed=budget)
    mask = tree_mask(ts)[:, None]  # [rows, 1 branch, n, n]
    case["blk_mask"] = mask.to(DEV)
    out, m, lsum = attn.branch_attention(**case, return_state=True)
    want = ref_of(case)
    for name, got, w in zip(["out", "m", "l"], (out, m, lsum), want):
        torch.testing.assert_close(got.cpu(), w, rtol=2e-5, atol=2e-5, msg=name)


def test_tree_node_equals_its_linear_path(monkeypatch):
    """A node's output under the tree mask equals the same tokens attended as a linear causal
    block of its path alone (what the tree verify promises the target computes)."""
    poison_empty(monkeypatch, attn)
    (t,) = trees(1, depth=5, budget=11, topk=3, seed=7)
    n = len(t) + 1
    case = make_case(1, 1, n, n, 8, 2, 64, 16, [40], seed=3)
    case["blk_mask"] = tree_mask([t])[:, None].to(DEV)
    out = attn.branch_attention(**case)
    node = n - 1  # the last node: walk its ancestors
    path = [node]
    while path[-1] != 0:
        path.append(t.parents[path[-1] - 1])
    path = path[::-1]  # root ... node (tree indices)
    idx = torch.tensor(path, device=case["q"].device)
    lin = dict(case, q=case["q"][:, :, idx], k_blk=case["k_blk"][:, :, idx],
               v_blk=case["v_blk"][:, :, idx],
               blk_mask=torch.ones(len(path), len(path)).tril().bool()[None].to(DEV))
    got = attn.branch_attention(**lin)
    torch.testing.assert_close(out[:, :, node].cpu(), got[:, :, -1].cpu(), rtol=2e-5, atol=2e-5)
