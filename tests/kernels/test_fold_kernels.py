"""Kernels added for the fast folded forward, vs specdec_kernels.reference (interpreter on CPU):
segmented
compaction with a capacity (overflow flagged by count, dropped sources get slot -1), the fused
gather + merge of two attention states (`merge_pair`), fp32 partial outputs of branch_attention.
Outputs are poisoned before launch (NaN / -7). Tolerance: fp32 1e-6 (same formula, other
rounding); bf16 output 1e-2; integer outputs exact."""

import math

import pytest
import torch
from specdec_kernels import reference as ref

from tests.kernels._util import DEV, direct, poison_empty

pytestmark = direct
gate_mod = pytest.importorskip("specdec_kernels.gate")
merge = pytest.importorskip("specdec_kernels.merge")
attn = pytest.importorskip("specdec_kernels.attention")


def forest_src(segments, k, n, seed, frac=0.6):
    """Fold sources of `segments` requests of k branches (random trees inside each request)."""
    g = torch.Generator().manual_seed(seed)
    par = []
    for s in range(segments):
        par += [-1] + [s * k + int(torch.randint(0, i, (1,), generator=g)) for i in range(1, k)]
    parent = torch.tensor(par, dtype=torch.int32)
    folded = (torch.rand(segments * k, n, generator=g) < frac) & (parent >= 0)[:, None]
    return ref.resolve_sources(folded, parent), parent, folded


@pytest.mark.parametrize("segments,k,n,cap", [(1, 5, 7, None), (3, 4, 5, None), (3, 4, 5, 9),
                                              (2, 3, 11, 0), (4, 1, 3, 2), (5, 7, 13, 33)])
def test_segmented_compaction_matches_reference(monkeypatch, segments, k, n, cap):
    poison_empty(monkeypatch, gate_mod)
    src, parent, folded = forest_src(segments, k, n, seed=segments * 10 + k)
    got = gate_mod.compact(src.to(DEV), segments, cap)
    want = ref.compact(src, segments, cap)
    for name, g, w in zip(["rows", "slot", "count"], got, want):
        assert torch.equal(g.cpu(), w), name
    # sources stay inside their request, so compact rows do too
    per = k * n
    c = per if cap is None else cap
    rows = want[0].view(segments, c)
    for s in range(segments):
        r = rows[s][rows[s] >= 0]
        assert ((r // per) == s).all()
        assert r.numel() == min(int(want[2][s]), c)
    fits = want[1] >= 0
    assert bool(fits.all()) == bool((want[2] <= c).all())
    # the fold plan passes both through (segments x capacity = the gate's forest)
    h = torch.randn(segments * k, n, 16)
    plan = gate_mod.fold_plan(h.to(DEV), parent.to(DEV), 0.5, segments=segments, capacity=cap)
    for name, g, w in zip(["rows", "slot", "count"], plan[3:],
                          ref.fold_plan(h, parent, 0.5, segments, cap)[3:]):
        assert torch.equal(g.cpu(), w), name


def test_compaction_overflow_then_scatter_is_safe():
    src, _, _ = forest_src(2, 6, 9, seed=1, frac=0.2)
    rows, slot, count = gate_mod.compact(src.to(DEV), 2, 4)
    assert (count.cpu() > 4).all()  # overflow is visible on the device
    y = torch.randn(8, 5, device=DEV)
    back = gate_mod.take_rows(y, slot)  # dropped sources read as zero rows, nothing out of range
    assert torch.equal(back[slot < 0].cpu(), torch.zeros(int((slot < 0).sum()), 5))


def states(r, h, d, seed, empty_every=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(r, h, d, generator=g)
    m = torch.randn(r, h, generator=g) * 3
    lsum = torch.rand(r, h, generator=g) * 5 + 0.1
    if empty_every:
        e = torch.arange(r * h).view(r, h) % empty_every == 0
        out[e], m[e], lsum[e] = 0.0, -math.inf, 0.0
    return out, m, lsum


@pytest.mark.parametrize("r,ra,h,d", [(1, 1, 1, 1), (7, 3, 3, 33), (37, 11, 6, 64), (5, 5, 4, 100)])
@pytest.mark.parametrize("gather", [True, False])
def test_merge_pair_matches_reference(monkeypatch, r, ra, h, d, gather):
    poison_empty(monkeypatch, merge)
    if not gather:
        ra = r
    a = states(ra, h, d, seed=r, empty_every=5)
    b = states(r, h, d, seed=r + 1, empty_every=7)
    idx = None
    if gather:
        g = torch.Generator().manual_seed(d)
        idx = torch.randint(-1, ra, (r,), generator=g, dtype=torch.int32)
        idx[0] = -1
    want = ref.merge_pair(*a, *b, rows_a=idx)
    got = merge.merge_pair(*(t.to(DEV) for t in (*a, *b)), rows_a=None if idx is None
                           else idx.to(DEV), return_state=True)
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_.cpu(), w, rtol=1e-6, atol=1e-6)
    assert not got[0].isnan().any()
    half = merge.merge_pair(*(t.to(DEV) for t in (*a, *b)), rows_a=None if idx is None
                            else idx.to(DEV), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float().cpu(), want[0], rtol=1e-2, atol=1e-2)


def test_merge_pair_of_prefix_and_block_equals_full_attention():
    """Prefix state of a compact query set, gathered by slot, merged with every row's block
    state: the full attention of the inherited queries (SpecFold's split)."""
    g = torch.Generator().manual_seed(4)
    nb, ql, h, kvh, d, ps, plen = 3, 5, 4, 2, 16, 4, 10
    q_c = torch.randn(1, 1, 6, h, d, generator=g)  # 6 compact rows
    slot = torch.tensor([0, 1, 2, 3, 4, 0, 1, 5, 3, 4, 0, 1, 5, 3, 2], dtype=torch.int32)
    kc = torch.randn(4, ps, kvh, d, generator=g)
    vc = torch.randn(4, ps, kvh, d, generator=g)
    prefix = dict(k_cache=kc, v_cache=vc, block_table=torch.tensor([[2, 0, 3]], dtype=torch.int32),
                  prefix_lens=torch.tensor([plen], dtype=torch.int32))
    kb = torch.randn(1, nb, ql, kvh, d, generator=g)
    vb = torch.randn(1, nb, ql, kvh, d, generator=g)
    q = q_c.reshape(6, h, d)[slot.long()].view(1, nb, ql, h, d)
    dev = {k_: t.to(DEV) for k_, t in prefix.items()}
    pre = attn.branch_attention(q_c.to(DEV), **dev, return_state=True, out_dtype=torch.float32)
    blk = attn.branch_attention(q.to(DEV), k_blk=kb.to(DEV), v_blk=vb.to(DEV), return_state=True)
    out = merge.merge_pair(pre[0].view(6, h, d), pre[1].view(6, h), pre[2].view(6, h),
                           blk[0].view(-1, h, d), blk[1].view(-1, h), blk[2].view(-1, h),
                           rows_a=slot.to(DEV))
    want = ref.attention(q, **prefix, k_blk=kb, v_blk=vb)[0]
    torch.testing.assert_close(out.view(want.shape).cpu(), want, rtol=2e-5, atol=2e-5)


def test_branch_attention_fp32_partials_from_bf16():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 4, 16, generator=g).to(torch.bfloat16)
    kb = torch.randn(1, 2, 3, 2, 16, generator=g).to(torch.bfloat16)
    out, m, lsum = attn.branch_attention(q.to(DEV), k_blk=kb.to(DEV), v_blk=kb.to(DEV),
                                         return_state=True, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    want = ref.attention(q.float(), k_blk=kb.float(), v_blk=kb.float())[0]
    torch.testing.assert_close(out.cpu(), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="out_dtype"):
        attn.branch_attention(q, k_blk=kb, v_blk=kb, out_dtype=torch.int32)


def test_bad_input_names_the_argument():
    src = torch.zeros(4, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="segments"):
        gate_mod.compact(src, 3)
    with pytest.raises(ValueError, match="capacity"):
        gate_mod.compact(src, 2, 7)
    o, m, lsum = states(4, 2, 8, seed=0)
    with pytest.raises(ValueError, match="rows_a"):
        merge.merge_pair(o, m, lsum, o, m, lsum, rows_a=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_a"):
        merge.merge_pair(o[:, :1], m[:, :1], lsum[:, :1], o, m, lsum)
    with pytest.raises(ValueError, match="m_b"):
        merge.merge_pair(o, m, lsum, o, m.double(), lsum)
