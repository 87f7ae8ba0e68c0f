"""The recursive rejection sampling kernel (`specdec_kernels.tree_rejection`) vs
`reference.tree_rejection` (interpreter on CPU): the same path, accepted length and bonus
exactly, given the same uniforms, on trees from `reference.tree_build` whose target mostly
agrees with the drafter (long paths) or never does (rejections everywhere, residuals chained
over every sibling), proposals with zero-probability siblings (the node ends there), and
vocabularies of one block and of several (the residual passes and the bonus's CDF cross block
borders). Outputs and the scratch rows are poisoned before each launch, so an unwritten element
or a read of an unwritten residual fails the test; argument errors name the argument."""

import pytest
import torch
from specdec_kernels import reference as ref

from tests.kernels._util import DEV, direct, poison_empty

pytestmark = direct
tr = pytest.importorskip("specdec_kernels.tree_rejection")


def case(b, g, k, n, v, seed, agree):
    gen = torch.Generator().manual_seed(seed)
    top_lp, top_ids = torch.randn(b, g, v, generator=gen).log_softmax(-1).topk(k, -1)
    tok, par, dep = ref.tree_build(top_lp, top_ids, n)
    zero = torch.zeros(b, 1, dtype=torch.long)
    draft = torch.cat([torch.randint(0, v, (b, 1), generator=gen), tok], 1)
    parents = torch.cat([zero, par], 1)
    q = torch.softmax(torch.randn(b, g, v, generator=gen) * 2, -1)
    logits = torch.randn(b, n + 1, v, generator=gen) * 2
    for r in range(b):
        for i in range(1, n + 1):  # the target at the parent favours its children's tokens
            logits[r, int(parents[r, i]), int(draft[r, i])] += agree
    if agree < 0:  # and a node whose children lie outside the proposal's support
        for r in range(b):
            q[r, 0, draft[r, parents[r] == 0]] = 0.0
        q = q / q.sum(-1, keepdim=True)
    p = torch.softmax(logits, -1)
    u = torch.rand(b, g, k, generator=gen)
    ub = torch.rand(b, generator=gen)
    return [x.to(DEV) for x in (p, q, draft, parents, u, ub)]


@pytest.mark.parametrize("b,g,k,n,v", [(3, 5, 3, 12, 37), (2, 7, 4, 20, 300),
                                       (2, 4, 2, 6, 5000), (1, 3, 1, 3, 64)])
@pytest.mark.parametrize("agree", [4.0, 0.0, -1.0])
def test_equals_reference(monkeypatch, b, g, k, n, v, agree):
    poison_empty(monkeypatch, tr)
    p, q, draft, parents, u, ub = case(b, g, k, n, v, 7 * b + n + v, agree)
    got = tr.tree_rejection(p, q, draft, parents, u, ub)
    want = ref.tree_rejection(*(x.cpu() for x in (p, q, draft, parents, u, ub)))
    for name, x, y in zip(("path", "accepted", "bonus"), got, want):
        assert x.dtype == y.dtype, name
        assert torch.equal(x.cpu(), y), (name, x, y)
    if agree > 0:
        assert int(want[1].max()) >= 2  # long paths were walked
    if agree < 0:
        assert int(want[1].max()) == 0  # no child of the root is in q's support


def test_many_rows_equal_reference(monkeypatch):
    """Many independent rows (different uniforms): the decisions that chain residuals agree."""
    poison_empty(monkeypatch, tr)
    p, q, draft, parents, u, ub = case(64, 4, 3, 10, 40, 5, 1.5)
    got = tr.tree_rejection(p, q, draft, parents, u, ub)
    want = ref.tree_rejection(*(x.cpu() for x in (p, q, draft, parents, u, ub)))
    for x, y in zip(got, want):
        assert torch.equal(x.cpu(), y)
    assert len(set(want[1].tolist())) >= 3


def test_bad_arguments_name_the_argument():
    p, q, draft, parents, u, ub = case(2, 3, 2, 5, 16, 1, 1.0)
    with pytest.raises(ValueError, match="q"):
        tr.tree_rejection(p, q[:, :2], draft, parents, u, ub)
    with pytest.raises(ValueError, match="p"):
        tr.tree_rejection(p.double(), q, draft, parents, u, ub)
    with pytest.raises(ValueError, match="parents"):
        tr.tree_rejection(p, q, draft, parents[:, :3], u, ub)
    with pytest.raises(ValueError, match="u_bonus"):
        tr.tree_rejection(p, q, draft, parents, u, ub[:1])
