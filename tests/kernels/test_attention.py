"""Paged branch attention vs specdec_kernels.reference.attention (interpreter on CPU, compiled on
GPU).

Outputs are NaN-poisoned before launch; cache pages no row references are NaN too, so reading
outside the block table shows up. Tolerance: fp32 atol = rtol = 2e-5 (CPU, ieee dots); bf16
atol = rtol = 2e-2 against the fp32 reference of the same bf16 inputs (on CPU the kernel
computes bf16 dots in fp32, see kernels/attention.py)."""

import math

import pytest
import torch
from specdec_kernels import reference as ref

from tests.kernels._util import CUDA, DEV, direct, poison_empty

pytestmark = direct
attn = pytest.importorskip("specdec_kernels.attention")
merge = pytest.importorskip("specdec_kernels.merge")


def make_case(rows, nb, ql, bl, h, kvh, d, ps, lens, seed, dtype=torch.float32, mask="dense"):
    g = torch.Generator().manual_seed(seed)
    max_pages = max(1, max(math.ceil(n / ps) for n in lens))
    pages = rows * max_pages + 3
    kc = torch.full((pages, ps, kvh, d), math.nan)
    vc = torch.full((pages, ps, kvh, d), math.nan)
    perm = torch.randperm(pages, generator=g)
    bt = torch.full((rows, max_pages), -1, dtype=torch.int32)  # -1 where unused
    used = 0
    for r, n in enumerate(lens):
        npg = math.ceil(n / ps)
        share = 1 if r and npg and bt[0, 0] >= 0 else 0  # rows share their first page
        if share:
            bt[r, 0] = bt[0, 0]
        for p in range(share, npg):
            bt[r, p] = perm[used]
            used += 1
        for p in range(npg):
            real = min(ps, n - p * ps)
            page = int(bt[r, p])
            kc[page, :real] = torch.randn(real, kvh, d, generator=g)
            vc[page, :real] = torch.randn(real, kvh, d, generator=g)
    q = torch.randn(rows, nb, ql, h, d, generator=g)
    kb = torch.randn(rows, nb, bl, kvh, d, generator=g)
    vb = torch.randn(rows, nb, bl, kvh, d, generator=g)
    m = None
    if mask == "causal":  # draft-graph style: query i sees block keys <= i (+ offset)
        m = (torch.arange(bl)[None] <= torch.arange(ql)[:, None] + (bl - ql))
        m = m[None].expand(nb, ql, bl).contiguous()
    elif mask == "random":
        m = torch.rand(rows, nb, ql, bl, generator=g) < 0.5
    case = dict(q=q, k_cache=kc, v_cache=vc, block_table=bt,
                prefix_lens=torch.tensor(lens, dtype=torch.int32), k_blk=kb, v_blk=vb,
                blk_mask=m)
    return {k: (v.to(DEV, dtype) if v is not None and v.is_floating_point() else
                v.to(DEV) if v is not None else None) for k, v in case.items()}


def ref_of(case, **kw):
    cpu = {k: (v.cpu().float() if v is not None and v.is_floating_point() else
               v.cpu() if v is not None else None) for k, v in case.items()}
    cpu.update({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    return ref.attention(**cpu)


CASES = [  # rows, branches, q_len, blk_len, heads, kv_heads, dim, page, prefix lens, mask
    (2, 1, 3, 3, 4, 4, 64, 16, [37, 0], "dense"),
    (2, 7, 5, 6, 8, 1, 128, 64, [70, 5], "causal"),
    (3, 7, 2, 4, 8, 2, 64, 16, [1, 33, 16], "random"),
]


@pytest.mark.parametrize("case_args", CASES, ids=["gqa1-p16", "gqa8-p64", "gqa4-rows3"])
def test_full_attention_matches_reference(monkeypatch, case_args):
    poison_empty(monkeypatch, attn)
    *shape, lens, mask = case_args
    case = make_case(*shape, lens, seed=len(lens) * 7 + shape[1], mask=mask)
    out, m, lsum = attn.branch_attention(**case, return_state=True)
    want = ref_of(case)
    for name, got, w in zip(["out", "m", "l"], (out, m, lsum), want):
        torch.testing.assert_close(got.cpu(), w, rtol=2e-5, atol=2e-5, msg=name)


def test_gpu_tile_sizes_in_interpreter(monkeypatch):
    """The GPU default tiles (64 x 64) with tiles spanning several branches."""
    poison_empty(monkeypatch, attn)
    case = make_case(2, 7, 3, 5, 8, 2, 64, 16, [90, 7], seed=2, mask="random")
    out = attn.branch_attention(**case, block_m=64, block_n=64)
    torch.testing.assert_close(out.cpu(), ref_of(case)[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("splits", [2, 5])
def test_split_k_matches_reference(monkeypatch, splits):
    poison_empty(monkeypatch, attn)
    case = make_case(3, 7, 2, 3, 8, 2, 64, 16, [1, 70, 33], seed=4, mask="random")
    pv = torch.randint(0, 80, (3, 7), dtype=torch.int32).to(DEV)
    got = attn.branch_attention(**case, prefix_visible=pv, return_state=True, num_splits=splits)
    want = ref_of(case, prefix_visible=pv)
    for name, g, w in zip(["out", "m", "l"], got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=2e-5, atol=2e-5, msg=name)


def test_merge_partials_kernel(monkeypatch):
    poison_empty(monkeypatch, merge)
    g = torch.Generator().manual_seed(0)
    out = torch.randn(3, 5, 4, 40, generator=g)
    m = torch.randn(3, 5, 4, generator=g) * 4
    lsum = torch.rand(3, 5, 4, generator=g) + 0.1
    out[1, 2], m[1, 2], lsum[1, 2] = 0, -math.inf, 0  # an empty partial
    out[:, 4], m[:, 4], lsum[:, 4] = 0, -math.inf, 0  # nothing anywhere
    want = (out[0], m[0], lsum[0])
    for s in (1, 2):
        want = ref.merge_states(*want, out[s], m[s], lsum[s])
    got = merge.merge_partials(out.to(DEV), m.to(DEV), lsum.to(DEV))
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_.cpu(), w, rtol=1e-5, atol=1e-6)
    assert (got[0][4] == 0).all() and torch.isneginf(got[1][4]).all()


def test_prefix_and_block_partials_merge_to_full(monkeypatch):
    """The SpecFold use: a prefix-only state and a block-only state merge into the full result."""
    poison_empty(monkeypatch, attn)
    case = make_case(2, 7, 4, 4, 8, 2, 64, 16, [21, 48], seed=5, mask="causal")
    pv = torch.tensor([[21, 0, 3, 21, 10, 21, 21], [48, 47, 1, 0, 16, 30, 99]],
                      dtype=torch.int32, device=DEV)  # 99 > prefix_len: clamped
    prefix_args = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "prefix_lens")}
    block_args = {k: case[k] for k in ("q", "k_blk", "v_blk", "blk_mask")}
    pre = attn.branch_attention(**prefix_args, prefix_visible=pv, return_state=True)
    blk = attn.branch_attention(**block_args, return_state=True)
    full = attn.branch_attention(**case, prefix_visible=pv, return_state=True)
    want_pre = ref_of(prefix_args, prefix_visible=pv)
    for got, w in zip(pre, want_pre):
        torch.testing.assert_close(got.cpu(), w, rtol=2e-5, atol=2e-5)
    hidden = pv.cpu() == 0  # branches that see no prefix key: out 0, m -inf, l 0
    assert (pre[0].cpu()[hidden] == 0).all() and (pre[2].cpu()[hidden] == 0).all()
    assert torch.isneginf(pre[1].cpu()[hidden]).all()
    merged = ref.merge_states(*pre, *blk)
    for got, w in zip(merged, full):
        torch.testing.assert_close(got.cpu(), w.cpu(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(full[0].cpu(), ref_of(case, prefix_visible=pv)[0], rtol=2e-5,
                               atol=2e-5)


def test_prefix_is_read_in_place(monkeypatch):
    """Zero copy: the wrapper allocates only out/m/l, and works on a strided view of the cache."""
    sizes = []
    real = torch.empty

    def empty(*size, **kw):
        t = real(*size, **kw)
        sizes.append(t.numel())
        return t.fill_(math.nan)
    monkeypatch.setattr(attn.torch, "empty", empty)
    case = make_case(2, 7, 3, 2, 4, 2, 64, 16, [40, 17], seed=9)
    big_k = torch.randn(*case["k_cache"].shape[:2], 4, 64, device=DEV)
    big_v = big_k.clone()
    big_k[:, :, 1::2] = case["k_cache"]  # the real cache is every second kv head of a bigger one
    big_v[:, :, 1::2] = case["v_cache"]
    case["k_cache"], case["v_cache"] = big_k[:, :, 1::2], big_v[:, :, 1::2]
    out, m, lsum = attn.branch_attention(**case, return_state=True)
    assert sizes == [out.numel(), m.numel(), lsum.numel()]
    torch.testing.assert_close(out.cpu(), ref_of(case)[0], rtol=2e-5, atol=2e-5)


def test_bf16():
    shape = (2, 7, 16, 16, 32, 8, 128, 64, [1000, 333]) if CUDA else (2, 2, 3, 3, 4, 1, 64, 16,
                                                                        [20, 33])
    case = make_case(*shape, seed=1, dtype=torch.bfloat16, mask="causal")
    out = attn.branch_attention(**case)
    torch.testing.assert_close(out.float().cpu(), ref_of(case)[0].float(), rtol=2e-2, atol=2e-2)


def test_bad_input_names_the_argument():
    case = make_case(1, 2, 2, 2, 4, 2, 16, 16, [5], seed=0)
    with pytest.raises(ValueError, match="k_cache / k_blk"):
        attn.branch_attention(case["q"])
    bad = dict(case, block_table=case["block_table"].long())
    with pytest.raises(ValueError, match="block_table"):
        attn.branch_attention(**bad)
    with pytest.raises(ValueError, match="prefix_lens"):
        attn.branch_attention(**dict(case, prefix_lens=torch.tensor([17], dtype=torch.int32)))
    with pytest.raises(ValueError, match="blk_mask"):
        attn.branch_attention(**dict(case, blk_mask=torch.ones(2, 2, 3, dtype=torch.bool)))
    with pytest.raises(ValueError, match="k_cache"):
        attn.branch_attention(**dict(case, k_cache=case["k_cache"][..., :8],
                                     v_cache=case["v_cache"][..., :8]))
    with pytest.raises(ValueError, match="q"):
        attn.branch_attention(**dict(case, q=case["q"].to(torch.int32)))


def test_k_and_v_with_different_strides(monkeypatch):
    """The kernel reads K and V with one set of strides: block K/V whose strides differ (views of
    one fused qkv tensor, say) are copied; caches whose strides differ are refused."""
    poison_empty(monkeypatch, attn)
    case = make_case(2, 3, 3, 4, 4, 2, 64, 16, [21, 9], seed=3, mask="random")
    kv = torch.stack([case["k_blk"], case["v_blk"]], dim=-2)  # [..., kv_heads, 2, dim]
    odd = dict(case, k_blk=kv[..., 0, :], v_blk=kv.transpose(-3, -2).contiguous()
               .transpose(-3, -2)[..., 1, :])
    assert odd["k_blk"].stride() != odd["v_blk"].stride()
    torch.testing.assert_close(attn.branch_attention(**odd).cpu(), ref_of(case)[0], rtol=2e-5,
                               atol=2e-5)
    vc = case["v_cache"].transpose(0, 1).contiguous().transpose(0, 1)  # same values, new strides
    with pytest.raises(ValueError, match="v_cache: strides"):
        attn.branch_attention(**dict(case, v_cache=vc))
