"""The fused tree build (`specdec_kernels.tree_build`) vs `reference.tree_build` (interpreter on
CPU): the same tokens, parents and depths exactly, on random drafter log-probs, on log-probs
rounded so that scores tie (the reference's stable order decides), with -inf entries, for chains
(top-1), single nodes, full capacity and depths past the budget. Outputs and scratch are
poisoned before each launch, so an unwritten element fails the test; argument errors name the
argument."""

import pytest
import torch
from specdec_kernels import reference as ref

from tests.kernels._util import DEV, direct, poison_empty

pytestmark = direct
tb = pytest.importorskip("specdec_kernels.tree_build")


def case(b, g, k, vocab, seed, step=None):
    gen = torch.Generator().manual_seed(seed)
    lp = torch.randn(b, g, vocab, generator=gen).log_softmax(-1)
    if step:  # coarse scores: many exact ties between prefixes
        lp = (lp / step).round() * step
    top_lp, top_ids = lp.topk(k, dim=-1)
    return top_lp.contiguous().to(DEV), top_ids.contiguous().to(DEV)


STEPS = (None, 0.25, 1.0)  # exact scores, then two coarser roundings (ties)


@pytest.mark.parametrize("b,g,k,n,steps", [
    (1, 4, 2, 5, STEPS), (1, 15, 4, 32, STEPS[:2]), (1, 15, 4, 64, STEPS[:1]),
    (2, 7, 3, 16, STEPS), (2, 6, 1, 6, STEPS), (1, 3, 2, 1, STEPS), (2, 3, 3, 39, STEPS),
    (1, 20, 4, 7, STEPS)])  # (the interpreter's sorts are slow: the 15-depth cases are short)
def test_equals_reference(monkeypatch, b, g, k, n, steps):
    poison_empty(monkeypatch, tb)
    for seed, step in enumerate(steps):
        top_lp, top_ids = case(b, g, k, 50, seed, step)
        got = tb.tree_build(top_lp, top_ids, n)
        want = ref.tree_build(top_lp.cpu(), top_ids.cpu(), n)
        for name, x, y in zip(("tokens", "parents", "depths"), got, want):
            assert x.dtype == y.dtype == torch.int64, name
            assert torch.equal(x.cpu(), y), (name, step, x, y)


def test_minus_inf_log_probs(monkeypatch):
    poison_empty(monkeypatch, tb)
    top_lp, top_ids = case(1, 9, 4, 30, 5)
    top_lp[:, 3:, 2:] = float("-inf")  # a drafter that puts no mass past rank 2 from depth 4
    got = tb.tree_build(top_lp, top_ids, 40)
    want = ref.tree_build(top_lp.cpu(), top_ids.cpu(), 40)
    assert all(torch.equal(x.cpu(), y) for x, y in zip(got, want))


def test_argument_errors():
    top_lp, top_ids = case(1, 4, 2, 20, 0)
    with pytest.raises(ValueError, match="budget"):
        tb.tree_build(top_lp, top_ids, 31)  # capacity 2 + 4 + 8 + 16 = 30
    with pytest.raises(ValueError, match="top_lp"):
        tb.tree_build(top_lp.double(), top_ids, 3)
    with pytest.raises(ValueError, match="top_ids"):
        tb.tree_build(top_lp, top_ids[:, :3], 3)


@pytest.mark.parametrize("b,g,k,n", [(3, 7, 3, 16), (1, 4, 2, 5), (2, 15, 4, 32), (2, 6, 1, 6),
                                     (1, 3, 3, 39), (70, 3, 2, 4)])
def test_tree_tensors_equal_reference(monkeypatch, b, g, k, n):
    """What the verify reads of each tree (`tree_tensors`): draft, positions, parents, depths,
    index, links, ancestor mask and FULL-mask positions, for seq_lens of either int dtype (70
    rows: the lengths before a row are summed over more than one chunk of 64)."""
    poison_empty(monkeypatch, tb)
    top_lp, top_ids = case(b, g, k, 50, n)
    tokens, parents, depths = ref.tree_build(top_lp.cpu(), top_ids.cpu(), n)
    gen = torch.Generator().manual_seed(n)
    root = torch.randint(0, 50, (b,), generator=gen)
    for dtype in (torch.int64, torch.int32):
        lens = torch.randint(1, 300, (b,), generator=gen).to(dtype)
        got = tb.tree_tensors(*(x.to(DEV) for x in (tokens, parents, depths, root, lens)), g)
        want = ref.tree_tensors(tokens, parents, depths, root, lens, g)
        names = ("draft", "positions", "parents", "depths", "index", "next_token",
                 "next_sibling", "anc", "mask_at")
        for name, x, y in zip(names, got, want):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x.cpu(), y), (name, dtype)
