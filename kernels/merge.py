"""Exact merge of partial attentions over disjoint key sets (Triton; spec: reference.merge_states).

A *partial* is (out, m, l): out normalised over its keys, m = max scaled score (natural-log
units), l = sum exp(score - m); an empty partial is (0, -inf, 0). Used to finish split-K
attention (kernels/attention.py) and to combine a prefix state with an own-block state.
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
