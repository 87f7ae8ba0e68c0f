"""Exact merge of partial attentions over disjoint key sets (Triton; spec: reference.merge_states).

A *partial* is (out, m, l): out normalised over its keys, m = max scaled score (natural-log
units), l = sum exp(score - m); an empty partial is (0, -inf, 0). `merge_partials` finishes
split-K attention (kernels/attention.py); `merge_pair` combines a prefix state with an own-block
state, gathering the prefix side by row index (SpecFold: folded rows share their source's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor, next_pow2


@triton.jit
def _merge_kernel(o_ptr, m_ptr, l_ptr, out_ptr, mo_ptr, lo_ptr, R, D, S, so_s, sm_s,
                  STATE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    r_ok = r < R
    tile = r_ok[:, None] & (d < D)[None, :]
    acc = tl.zeros([BR, BD], dtype=tl.float32)
    m_run = tl.full([BR], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([BR], dtype=tl.float32)
    for s in range(S):
        m_s = tl.load(m_ptr + s * sm_s + r, mask=r_ok, other=float("-inf"))
        l_s = tl.load(l_ptr + s * sm_s + r, mask=r_ok, other=0.0)
        o_s = tl.load(o_ptr + s * so_s + r.to(tl.int64)[:, None] * D + d[None, :], mask=tile,
                      other=0.0).to(tl.float32)
        m_new = tl.maximum(m_run, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a_run = tl.exp(m_run - m_safe) * l_run
        a_s = tl.exp(m_s - m_safe) * l_s
        acc = acc * (a_run / tl.where(a_run + a_s > 0, a_run + a_s, 1.0))[:, None] \
            + o_s * (a_s / tl.where(a_run + a_s > 0, a_run + a_s, 1.0))[:, None]
        m_run = m_new
        l_run = a_run + a_s
    tl.store(out_ptr + r.to(tl.int64)[:, None] * D + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=tile)
    if STATE:
        tl.store(mo_ptr + r, m_run, mask=r_ok)
        tl.store(lo_ptr + r, l_run, mask=r_ok)


def merge_partials(out, m, lsum, dtype=None, return_state=True):
    """out [splits, *lead, dim] float, m / lsum [splits, *lead] fp32 (contiguous)
    -> merged out [*lead, dim] (dtype, default out.dtype), and m, l [*lead] with return_state."""
    check_tensor("out", out, None, (torch.float32, torch.float16, torch.bfloat16))
    if out.dim() < 2:
        raise ValueError(f"out: needs [splits, ..., dim], got shape {tuple(out.shape)}")
    for name, t in (("m", m), ("lsum", lsum)):
        check_tensor(name, t, out.dim() - 1, (torch.float32,), out.device)
        check_shape(name, t, tuple(out.shape[:-1]))
    s, d = out.shape[0], out.shape[-1]
    lead = tuple(out.shape[1:-1])
    r = m[0].numel()
    res = torch.empty(*lead, d, dtype=dtype or out.dtype, device=out.device)
    mo = torch.empty(lead, dtype=torch.float32, device=out.device) if return_state else res
    lo = torch.empty(lead, dtype=torch.float32, device=out.device) if return_state else res
    if r and d:
        br = 16
        _merge_kernel[(triton.cdiv(r, br),)](out, m, lsum, res, mo, lo, r, d, s, r * d, r,
                                             STATE=return_state, BR=br, BD=next_pow2(d))
    return (res, mo, lo) if return_state else res


@triton.jit
def _merge_pair_kernel(oa_ptr, ma_ptr, la_ptr, ia_ptr, ob_ptr, mb_ptr, lb_ptr, out_ptr, mo_ptr,
                       lo_ptr, RH, H, D, HAS_IDX: tl.constexpr, STATE: tl.constexpr,
                       BR: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0) * BR + tl.arange(0, BR)  # flat (row, head) of b and of the output
    d = tl.arange(0, BD)
    ok = t < RH
    if HAS_IDX:  # a's row of each output row: a gather, -1 = empty
        ra = tl.load(ia_ptr + t // H, mask=ok, other=-1)
        a_ok = ok & (ra >= 0)
        ta = tl.maximum(ra, 0).to(tl.int64) * H + t % H
    else:
        a_ok = ok
        ta = t.to(tl.int64)
    m_a = tl.load(ma_ptr + ta, mask=a_ok, other=float("-inf"))
    l_a = tl.load(la_ptr + ta, mask=a_ok, other=0.0)
    m_b = tl.load(mb_ptr + t, mask=ok, other=float("-inf"))
    l_b = tl.load(lb_ptr + t, mask=ok, other=0.0)
    m = tl.maximum(m_a, m_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = l_a * tl.exp(m_a - m_safe)
    w_b = l_b * tl.exp(m_b - m_safe)
    lsum = w_a + w_b
    inv = 1.0 / tl.where(lsum > 0, lsum, 1.0)
    d_ok = (d < D)[None, :]
    o_a = tl.load(oa_ptr + ta[:, None] * D + d[None, :], mask=a_ok[:, None] & d_ok,
                  other=0.0).to(tl.float32)
    o_b = tl.load(ob_ptr + t.to(tl.int64)[:, None] * D + d[None, :], mask=ok[:, None] & d_ok,
                  other=0.0).to(tl.float32)
    out = o_a * (w_a * inv)[:, None] + o_b * (w_b * inv)[:, None]
    tl.store(out_ptr + t.to(tl.int64)[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok[:, None] & d_ok)
    if STATE:
        tl.store(mo_ptr + t, m, mask=ok)
        tl.store(lo_ptr + t, lsum, mask=ok)


def merge_pair(out_a, m_a, l_a, out_b, m_b, l_b, rows_a=None, dtype=None, return_state=False):
    """Merge two partials in one launch; a may be gathered: output row r merges a's row
    rows_a[r] (-1 = empty; None = row r) with b's row r. SpecFold's use: a = prefix states of
    the compact (recomputed) rows, rows_a = slot, b = own-block states of every row.

    out_a,  # [Ra, heads, dim] float; m_a, l_a [Ra, heads] fp32 (contiguous)
    out_b,  # [R, heads, dim] float;  m_b, l_b [R, heads] fp32 (contiguous)
    rows_a,  # [R] int32 (entries in [-1, Ra)) or None (then Ra = R)
    returns out [R, heads, dim] (dtype, default out_b.dtype); with return_state also m, l."""
    check_tensor("out_b", out_b, 3, (torch.float32, torch.float16, torch.bfloat16))
    r, h, d = out_b.shape
    check_tensor("out_a", out_a, 3, (torch.float32, torch.float16, torch.bfloat16), out_b.device)
    if out_a.shape[1:] != out_b.shape[1:]:
        raise ValueError(f"out_a: shape {tuple(out_a.shape)} must match out_b's heads and dim "
                         f"{tuple(out_b.shape[1:])}")
    ra = out_a.shape[0]
    for name, t, rr in (("m_a", m_a, ra), ("l_a", l_a, ra), ("m_b", m_b, r), ("l_b", l_b, r)):
        check_tensor(name, t, 2, (torch.float32,), out_b.device)
        check_shape(name, t, (rr, h))
    if rows_a is None:
        check_shape("out_a", out_a, (r, h, d))
    else:
        check_tensor("rows_a", rows_a, 1, (torch.int32,), out_b.device)
        check_shape("rows_a", rows_a, (r,))
    dev = out_b.device
    out = torch.empty(r, h, d, dtype=dtype or out_b.dtype, device=dev)
    mo = torch.empty(r, h, dtype=torch.float32, device=dev) if return_state else out
    lo = torch.empty(r, h, dtype=torch.float32, device=dev) if return_state else out
    if r * h and d:
        br = 32 if dev.type == "cuda" else 256  # the CPU interpreter runs programs serially
        ia = rows_a if rows_a is not None else m_b
        _merge_pair_kernel[(triton.cdiv(r * h, br),)](
            out_a, m_a, l_a, ia, out_b, m_b, l_b, out, mo, lo, r * h, h, d,
            HAS_IDX=rows_a is not None, STATE=return_state, BR=br, BD=next_pow2(d))
    return (out, mo, lo) if return_state else out
