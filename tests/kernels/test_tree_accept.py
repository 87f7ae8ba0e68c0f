"""The fused greedy acceptance (`specdec_kernels.tree_accept`) vs `reference.tree_accept`
(interpreter on CPU): the same committed tokens, path, lengths, bonus and KV move pairs exactly,
on trees from `reference.tree_build` with target choices that mostly follow a child (long
paths), never follow one (the root only), always follow the first child (the deepest path), and
with dead (padded) rows. Outputs are poisoned before each launch, so an unwritten element fails
the test; argument errors name the argument."""

import pytest
import torch
from specdec_kernels import reference as ref

from tests.kernels._util import DEV, direct, poison_empty

pytestmark = direct
ta = pytest.importorskip("specdec_kernels.tree_accept")


def case(b, g, k, n, seed, follow):
    gen = torch.Generator().manual_seed(seed)
    top_lp, top_ids = torch.randn(b, g, 40, generator=gen).log_softmax(-1).topk(k, -1)
    tok, par, dep = ref.tree_build(top_lp, top_ids, n)
    zero = torch.zeros(b, 1, dtype=torch.long)
    draft = torch.cat([torch.randint(0, 40, (b, 1), generator=gen), tok], 1)
    parents, depths = torch.cat([zero, par], 1), torch.cat([zero, dep], 1)
    choice = torch.randint(0, 40, (b, n + 1), generator=gen)
    for r in range(b):
        for node in range(n + 1):
            kids = [i for i in range(1, n + 1) if int(parents[r, i]) == node]
            if kids and (follow == "first" or float(torch.rand((), generator=gen)) < follow):
                pick = 0 if follow == "first" else int(torch.randint(len(kids), (),
                                                                     generator=gen))
                choice[r, node] = draft[r, kids[pick]]
            elif kids and follow == 0:
                choice[r, node] = 40 + node  # a token no child carries
    loc = 1 + torch.randperm(5000, generator=gen)[:b * (n + 1)].view(b, n + 1)
    live = torch.ones(b, dtype=torch.bool)
    return [x.to(DEV) for x in (choice, draft, parents, depths, loc, live)]


@pytest.mark.parametrize("b,g,k,n", [(3, 7, 3, 16), (1, 4, 2, 5), (2, 15, 4, 32), (2, 6, 1, 6)])
@pytest.mark.parametrize("follow", [0.8, 0, "first"])
def test_equals_reference(monkeypatch, b, g, k, n, follow):
    poison_empty(monkeypatch, ta)
    choice, draft, parents, depths, loc, live = case(b, g, k, n, b * 100 + n, follow)
    if b > 1:
        live[-1] = False  # a padded row: no path, no move
    got = ta.tree_accept(choice, draft, parents, loc, live, g)
    want = ref.tree_accept(choice.cpu(), draft.cpu(), parents.cpu(), depths.cpu(), loc.cpu(),
                           live.cpu(), g)
    for name, x, y in zip(("predict", "path", "n", "bonus", "tgt", "src"), got, want):
        assert x.dtype == y.dtype, name
        assert torch.equal(x.cpu(), y), (name, x, y)
    n_path = want[2]
    if follow == 0:
        assert n_path[live.cpu()].eq(1).all()
    if follow == "first":  # the chain of first children, to its end
        for r in range(b - 1 if b > 1 else b):
            node, length = 0, 1
            while kids := [i for i in range(1, n + 1) if int(parents[r, i]) == node]:
                node, length = kids[0], length + 1
            assert int(n_path[r]) == length, r
    if b > 1:
        assert int(n_path[-1]) == 0 and not want[4][-1].any()


def test_argument_errors():
    choice, draft, parents, depths, loc, live = case(1, 4, 2, 5, 0, 0.5)
    with pytest.raises(ValueError, match="depth"):
        ta.tree_accept(choice, draft, parents, loc, live, 6)
    with pytest.raises(ValueError, match="live"):
        ta.tree_accept(choice, draft, parents, loc, live.int(), 4)
    with pytest.raises(ValueError, match="loc"):
        ta.tree_accept(choice, draft, parents, loc[:, :3], live, 4)
