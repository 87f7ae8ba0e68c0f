"""Gate, fold-source resolution and compaction kernels vs specdec_kernels.reference
(interpreter on CPU).

Outputs are poisoned (NaN / sentinel) before each launch so unwritten elements fail the test.
rho tolerance: fp32 rtol 1e-5 (sum order differs); everything else must match exactly."""

import pytest
import torch
from specdec_kernels import reference as ref

from tests.kernels._util import DEV, direct, poison_empty

pytestmark = direct
gate_mod = pytest.importorskip("specdec_kernels.gate")


def tree_case(nb, n, d, seed, near_frac=0.5):
    """Random forest (parent < index) with hidden states close to the parent at ~near_frac."""
    g = torch.Generator().manual_seed(seed)
    parent = torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in
                                  range(1, nb)], dtype=torch.int32)
    h = torch.empty(nb, n, d)
    for i in range(nb):
        fresh = torch.randn(n, d, generator=g)
        if parent[i] < 0:
            h[i] = fresh
        else:
            near = torch.rand(n, 1, generator=g) < near_frac
            scale = torch.where(near, 0.02, 1.0)
            h[i] = h[parent[i]] + scale * fresh
    return h, parent


@pytest.mark.parametrize("nb,n,d", [(1, 5, 33), (7, 13, 64), (7, 1, 1000), (12, 9, 2049)])
def test_fold_plan_matches_reference(monkeypatch, nb, n, d):
    poison_empty(monkeypatch, gate_mod)
    h, parent = tree_case(nb, n, d, seed=nb * 100 + n)
    got = gate_mod.fold_plan(h.to(DEV), parent.to(DEV), delta=0.1)
    want = ref.fold_plan(h, parent, 0.1)
    torch.testing.assert_close(got.rho.cpu(), want[0], rtol=1e-5, atol=0)
    for name, g, w in zip(["folded", "src", "rows", "slot", "count"], got[1:], want[1:]):
        assert torch.equal(g.cpu(), w), name
    if nb > 1:
        assert want[1].any() and not want[1].all(), "case must mix folded and recomputed rows"
        assert not want[1][parent < 0].any(), "roots are never folded"


def test_fold_chain_resolves_to_nearest_recomputed_ancestor():
    # chain 0 <- 1 <- 2 <- 3, position 0 folded in 1, 2, 3; position 1 folded only in 3
    parent = torch.tensor([-1, 0, 1, 2], dtype=torch.int32)
    folded = torch.tensor([[0, 0], [1, 0], [1, 0], [1, 1]], dtype=torch.bool)
    src = gate_mod.resolve_sources(folded.to(DEV), parent.to(DEV)).cpu()
    assert src.tolist() == [[0, 1], [0, 3], [0, 5], [0, 5]]
    rows, slot, count = gate_mod.compact(src.to(DEV))
    assert count.item() == 4 and rows.cpu().tolist() == [0, 1, 3, 5, -1, -1, -1, -1]
    assert slot.cpu().tolist() == [0, 1, 0, 2, 0, 3, 0, 3]


def test_gather_compute_scatter_equals_inherit(monkeypatch):
    """Compute f on the compact batch, scatter back: every row gets f(its source row)."""
    poison_empty(monkeypatch, gate_mod)
    h, parent = tree_case(7, 11, 24, seed=3)
    plan = gate_mod.fold_plan(h.to(DEV), parent.to(DEV), 0.1)
    x = h.reshape(-1, 24).to(DEV)
    dense = gate_mod.take_rows(x, plan.rows)
    torch.testing.assert_close(dense.cpu(), ref.gather_rows(x.cpu(), plan.rows.cpu()), rtol=0,
                               atol=0)
    m = plan.count.item()
    assert (dense[m:] == 0).all()
    y = torch.tanh(dense[:m] * 3)  # stands in for QKV / FFN on the recomputed rows
    back = gate_mod.take_rows(y, plan.slot)
    want = torch.tanh(x[plan.src.reshape(-1).long()] * 3)
    torch.testing.assert_close(back, want, rtol=0, atol=0)
    torch.testing.assert_close(back.cpu(), ref.scatter_rows(y.cpu(), plan.slot.cpu()))


def test_compact_larger_than_one_scan_chunk():
    g = torch.Generator().manual_seed(0)
    nb, n = 40, 60  # 2400 rows > BLOCK 1024
    parent = torch.tensor([-1] + list(range(nb - 1)), dtype=torch.int32)
    folded = torch.rand(nb, n, generator=g) < 0.6
    folded[0] = False
    src = ref.resolve_sources(folded, parent)
    got = gate_mod.compact(src.to(DEV))
    for g_, w in zip(got, ref.compact(src)):
        assert torch.equal(g_.cpu(), w)


def test_bad_input_names_the_argument():
    h = torch.randn(3, 4, 8)
    with pytest.raises(ValueError, match="parent"):
        gate_mod.gate(h, torch.tensor([-1, 0, 0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"parent\[1\]"):
        gate_mod.gate(h, torch.tensor([-1, 1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="hidden"):
        gate_mod.gate(h.to(torch.int32), torch.tensor([-1, 0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="hidden"):
        gate_mod.gate(h.transpose(0, 1), torch.tensor([-1, 0, 0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="delta"):
        gate_mod.gate(h, torch.tensor([-1, 0, 0], dtype=torch.int32), delta=-1.0)
    with pytest.raises(ValueError, match="idx"):
        gate_mod.take_rows(h[0], torch.zeros(3, dtype=torch.int64))
