"""The kernels composed the way SpecFold uses them, checked against one dense reference attention.

Gate -> compact the recomputed rows -> project Q/K/V only there -> prefix-only attention of the
compact queries (all of a request's branches share the prefix, so they form one query block) ->
scatter (out, m, l), Q, K, V back to every row (folded rows take their source's) -> own-block
attention of all rows -> merge. Equals full attention of the inherited Q/K/V (fp32, 2e-5)."""

import pytest
import torch
from specdec_kernels import reference as ref

from tests.kernels._util import DEV, direct

pytestmark = direct
gate = pytest.importorskip("specdec_kernels.gate")
attn = pytest.importorskip("specdec_kernels.attention")


def test_folded_verification_flow():
    g = torch.Generator().manual_seed(0)
    nb, ql, h, kvh, d, ps, plen = 5, 4, 4, 2, 32, 16, 41
    parent = torch.tensor([-1, 0, 0, 1, -1], dtype=torch.int32)
    hid = torch.randn(nb, ql, h * d, generator=g)
    for i in (1, 2, 3):
        near = torch.rand(ql, 1, generator=g) < 0.5
        hid[i] = hid[parent[i]] + torch.where(near, 0.01, 1.0) * torch.randn(ql, h * d,
                                                                             generator=g)
    wq, wk, wv = (torch.randn(h * d, n * d, generator=g) / d for n in (h, kvh, kvh))
    pages = torch.randn(2, 6, ps, kvh, d, generator=g)
    bt = torch.tensor([[4, 1, 3]], dtype=torch.int32)
    hid, parent, wq, wk, wv, pages, bt = (t.to(DEV) for t in (hid, parent, wq, wk, wv, pages, bt))
    prefix = dict(k_cache=pages[0], v_cache=pages[1], block_table=bt,
                  prefix_lens=torch.tensor([plen], dtype=torch.int32, device=DEV))

    plan = gate.fold_plan(hid, parent, delta=0.1)
    m = int(plan.count)
    assert 0 < m < nb * ql
    dense = gate.take_rows(hid.reshape(nb * ql, h * d), plan.rows)[:m]  # recomputed rows only
    q_c = dense @ wq  # [m, h*d]
    pre = attn.branch_attention(q_c.view(1, 1, m, h, d), **prefix, return_state=True)
    pre_all = [gate.take_rows(t.reshape(m, -1), plan.slot).view(1, nb, ql, h, -1)
               for t in pre]  # [1, nb, ql, h, d | 1]
    q = gate.take_rows(q_c, plan.slot).view(1, nb, ql, h, d)
    k = gate.take_rows(dense @ wk, plan.slot).view(1, nb, ql, kvh, d)
    v = gate.take_rows(dense @ wv, plan.slot).view(1, nb, ql, kvh, d)
    mask = torch.tril(torch.ones(ql, ql, dtype=torch.bool, device=DEV))[None].expand(nb, -1, -1)
    blk = attn.branch_attention(q, k_blk=k, v_blk=v, blk_mask=mask, return_state=True)
    out, _, _ = ref.merge_states(pre_all[0], pre_all[1][..., 0], pre_all[2][..., 0], *blk)

    want = ref.attention(q.cpu(), **{k_: t.cpu() for k_, t in prefix.items()}, k_blk=k.cpu(),
                         v_blk=v.cpu(), blk_mask=mask.cpu())[0]
    torch.testing.assert_close(out.cpu(), want, rtol=2e-5, atol=2e-5)
    # folded rows really inherited: their q equals their source's
    src = plan.src.reshape(-1).long()
    qf = q.reshape(nb * ql, -1)
    assert torch.equal(qf, qf[src]) and bool((src != torch.arange(nb * ql, device=DEV)).any())
