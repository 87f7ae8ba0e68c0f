"""Streaming (online-softmax) attention of many draft branches over a shared paged prefix.

Per batch row (a request): a *prefix* KV cache addressed through a paged block table, seen by all
branches of the row without copies (every program reads the same pages through the table), then
each branch's own *block* K/V under a per-branch visibility mask. GQA: the query heads that share
a KV head are packed into one tile, whose rows are (branch, query position, head in group).
State (m, l) is in natural-log units: m = max of scale * q.k, l = sum exp(scale * q.k - m); a query
that sees no key gets out = 0, m = -inf, l = 0. Pass only the prefix or only the block arguments to
get one partial attention; specdec_kernels.reference.merge_states combines two partials exactly.
Split-K: with num_splits S > 1 each program takes 1/S of the prefix pages (the last also the
blocks) and writes an fp32 partial; merge.merge_partials combines them (GPU: S is chosen
so that about two programs run per SM). With `split_tokens` T each split covers the fixed slots
[s * T, s * T + T) instead: which split (and which key tile) a key lands in then depends on its
slot alone, not on the row's prefix length, so a query attends in the same order whether it
runs alone or with more queries (batch-invariant decode vs verify; with a fixed block_m).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor, next_pow2
from ._dot import dot
from .merge import merge_partials

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32,)
_LOG2E = 1.4426950408889634


@triton.jit
def _online_step(acc, m_i, l_i, s, v, PREC: tl.constexpr, CPU: tl.constexpr):
    # s [BM, BN] log2-scaled scores with -inf where hidden; v [BN, BD]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PREC, CPU)
    return acc, m_new, l_i


@triton.jit
def _tile_scores(q, k_ptr, v_ptr, off, mask, d, qk_scale, CPU: tl.constexpr,
                 PREC: tl.constexpr):
    """One key tile at element offsets `off` [BN] (+ d): the scores q k^T * scale [BM, BN] and
    the values [BN, BD] (fp32 on CPU; masked keys load as 0)."""
    k = tl.load(k_ptr + off[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + off[:, None] + d[None, :], mask=mask, other=0.0)
    if CPU:  # the interpreter's bf16 tl.dot is wrong (triton 3.9): `dot` runs fp32 there, and
        v = v.to(tl.float32)  # p must stay fp32 on its way in (`_online_step`: p.to(v.dtype))
    return dot(q, tl.trans(k), PREC, CPU) * qk_scale, v


@triton.jit
def _branch_attn_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, plen_ptr, pvis_ptr, kb_ptr, vb_ptr, mask_ptr,
        out_ptr, m_ptr, l_ptr,
        sq_r, sq_b, sq_t, sq_h, sc_p, sc_s, sc_h, sbt_r, sb_r, sb_b, sb_t, sb_h,
        sm_r, sm_b, sm_q, so_r, so_b, so_t, so_h, so_s, ss_s,
        NB, QL, BL, KVH, NS, SPLIT, qk_scale,
        G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
        HAS_PREFIX: tl.constexpr, HAS_PVIS: tl.constexpr, HAS_BLOCK: tl.constexpr,
        HAS_MASK: tl.constexpr, STATE: tl.constexpr, PREC: tl.constexpr, CPU: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    pid_m = tl.program_id(0)
    row = tl.program_id(1) // KVH
    kvh = tl.program_id(1) % KVH
    split = tl.program_id(2)  # split-K over the prefix; the last split also takes the blocks
    T = NB * QL * G
    t = pid_m * BM + tl.arange(0, BM)  # packed query rows: (branch, position, head in group)
    t_ok = t < T
    b = t // (QL * G)
    qp = (t // G) % QL
    head = kvh * G + t % G
    d = tl.arange(0, BD)
    d_ok = d < D
    q_off = row.to(tl.int64) * sq_r + b * sq_b + qp * sq_t + head * sq_h
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    if HAS_PREFIX:
        plen = tl.load(plen_ptr + row)
        vis_len = tl.zeros([BM], dtype=tl.int32) + plen
        if HAS_PVIS:
            vis_len = tl.minimum(vis_len, tl.load(pvis_ptr + row * NB + b, mask=t_ok, other=0))
        per = tl.cdiv(tl.cdiv(plen, BN), NS) * BN
        if SPLIT > 0:  # fixed spans: the split of a key does not depend on plen
            per = SPLIT
        for j0 in range(split * per, tl.minimum(plen, split * per + per), BN):
            j = j0 + tl.arange(0, BN)
            j_ok = j < plen
            page = tl.load(bt_ptr + row * sbt_r + j // PS, mask=j_ok, other=0).to(tl.int64)
            kv_off = page * sc_p + (j % PS) * sc_s + kvh * sc_h
            kv_mask = j_ok[:, None] & d_ok[None, :]
            s, v = _tile_scores(q, kc_ptr, vc_ptr, kv_off, kv_mask, d, qk_scale, CPU,
                                PREC)
            s = tl.where(j[None, :] < vis_len[:, None], s, float("-inf"))
            acc, m_i, l_i = _online_step(acc, m_i, l_i, s, v, PREC, CPU)
    if HAS_BLOCK:
        # only the blocks of the branches present in this tile
        b_lo = (pid_m * BM) // (QL * G)
        b_hi = tl.minimum(pid_m * BM + BM - 1, T - 1) // (QL * G)
        u_hi = tl.where(split == NS - 1, (b_hi + 1) * BL, b_lo * BL)
        for u0 in range(b_lo * BL, u_hi, BN):
            u = u0 + tl.arange(0, BN)
            u_ok = u < (b_hi + 1) * BL
            kb = u // BL
            kp = u % BL
            kv_off = row.to(tl.int64) * sb_r + kb * sb_b + kp * sb_t + kvh * sb_h
            kv_mask = u_ok[:, None] & d_ok[None, :]
            s, v = _tile_scores(q, kb_ptr, vb_ptr, kv_off, kv_mask, d, qk_scale, CPU,
                                PREC)
            vis = (kb[None, :] == b[:, None]) & u_ok[None, :] & t_ok[:, None]
            if HAS_MASK:
                mk_off = row * sm_r + b[:, None] * sm_b + qp[:, None] * sm_q + kp[None, :]
                vis = vis & (tl.load(mask_ptr + mk_off, mask=vis, other=0) != 0)
            s = tl.where(vis, s, float("-inf"))
            acc, m_i, l_i = _online_step(acc, m_i, l_i, s, v, PREC, CPU)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (split.to(tl.int64) * so_s + row.to(tl.int64) * so_r + b * so_b + qp * so_t
             + head * so_h)
    tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & d_ok[None, :])
    if STATE:
        s_off = (split.to(tl.int64) * ss_s + (row.to(tl.int64) * NB * QL + b * QL + qp) * (KVH * G)
                 + head)
        tl.store(m_ptr + s_off, m_i * 0.6931471805599453, mask=t_ok)  # log2 -> natural units
        tl.store(l_ptr + s_off, l_i, mask=t_ok)


def check_paged_cache(q, heads: int, dim: int, k_cache, v_cache, block_table, prefix_lens,
                      validate: bool) -> tuple[int, int, int]:
    """The paged prefix arguments both attention kernels take (one set of strides for K and V,
    pages in use within the pool); `validate` adds the checks that read the device (a sync).
    Returns (pages, page_size, kv_heads)."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, 4, (q.dtype,), q.device, contiguous=False, last_contiguous=True)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if v_cache.stride() != k_cache.stride():  # the kernels read both with one set of strides
        raise ValueError(f"v_cache: strides {v_cache.stride()} must equal k_cache's "
                         f"{k_cache.stride()}")
    pages, ps, kvh, dk = k_cache.shape
    if dk != dim or heads % kvh:
        raise ValueError(f"k_cache: shape {tuple(k_cache.shape)} needs head_dim {dim} and "
                         f"kv_heads dividing the {heads} query heads")
    check_tensor("block_table", block_table, 2, _INTS, q.device, contiguous=False,
                 last_contiguous=True)
    check_tensor("prefix_lens", prefix_lens, 1, _INTS, q.device)
    check_shape("prefix_lens", prefix_lens, (block_table.shape[0],))
    if validate:  # host reads: a sync on GPU (hot loops pass validate=False)
        cap = block_table.shape[1] * ps
        if bool(((prefix_lens < 0) | (prefix_lens > cap)).any()):
            raise ValueError(f"prefix_lens: must lie in [0, {cap}] (block_table pages x page "
                             f"size), got {prefix_lens.tolist()}")
        j = torch.arange(block_table.shape[1], device=q.device)
        used = j[None] * ps < prefix_lens[:, None]
        if bool((used & ((block_table < 0) | (block_table >= pages))).any()):
            raise ValueError(f"block_table: entries in use must lie in [0, {pages})")
    return pages, ps, kvh


def _check_prefix(q, k_cache, v_cache, block_table, prefix_lens, prefix_visible, validate):
    rows, nb, _, h, d = q.shape
    check_shape("block_table", block_table, (rows, None))
    check_paged_cache(q, h, d, k_cache, v_cache, block_table, prefix_lens, validate)
    if prefix_visible is not None:
        check_tensor("prefix_visible", prefix_visible, 2, _INTS, q.device)
        check_shape("prefix_visible", prefix_visible, (rows, nb))


def _check_block(q, k_blk, v_blk, blk_mask):
    rows, nb, ql, h, d = q.shape
    for name, t in (("k_blk", k_blk), ("v_blk", v_blk)):
        check_tensor(name, t, 5, (q.dtype,), q.device, contiguous=False, last_contiguous=True)
        check_shape(name, t, (rows, nb, None, None, d))
    check_shape("v_blk", v_blk, tuple(k_blk.shape))
    if h % k_blk.shape[3]:
        raise ValueError(f"k_blk: kv_heads {k_blk.shape[3]} must divide the {h} query heads")
    if blk_mask is not None:
        check_tensor("blk_mask", blk_mask, None, (torch.bool,), q.device, contiguous=False,
                     last_contiguous=True)
        bl = k_blk.shape[2]
        if blk_mask.dim() == 3:
            check_shape("blk_mask", blk_mask, (nb, ql, bl))
        else:
            check_shape("blk_mask", blk_mask, (rows, nb, ql, bl))


def branch_attention(
    q,  # [rows, branches, q_len, heads, dim]
    k_cache=None,  # [pages, page_size, kv_heads, dim] shared prefix cache
    v_cache=None,  # [pages, page_size, kv_heads, dim]
    block_table=None,  # [rows, max_pages] int32 page ids of each row's prefix
    prefix_lens=None,  # [rows] int32 prefix tokens of each row
    k_blk=None,  # [rows, branches, blk_len, kv_heads, dim] each branch's own keys
    v_blk=None,  # [rows, branches, blk_len, kv_heads, dim]
    blk_mask=None,  # [branches | rows x branches, q_len, blk_len] bool, True = visible; None = all
    prefix_visible=None,  # [rows, branches] int32: branch sees prefix[:min(this, prefix_len)]
    scale: float | None = None,  # default 1/sqrt(dim)
    return_state: bool = False,
    validate: bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,  # split-K over the prefix; None = auto (1 on CPU)
    split_tokens: int | None = None,  # fixed prefix slots per split (a multiple of block_n)
    out_dtype: torch.dtype | None = None,  # default q.dtype; fp32 keeps partials for a merge
):
    """Returns out [rows, branches, q_len, heads, dim] (out_dtype, default q.dtype), and with
    return_state also m, l [rows, branches, q_len, heads] fp32 (module docstring). Give the
    prefix arguments, the block arguments, or both. Only q-dtype tensors with a contiguous last
    dim; any other strides (e.g. views into a larger cache) are used as they are. k_cache and
    v_cache must share strides; k_blk / v_blk whose strides differ are copied to contiguous."""
    check_tensor("q", q, 5, _FLOATS, contiguous=False, last_contiguous=True)
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise ValueError(f"out_dtype: {out_dtype} not allowed (float32, float16, bfloat16)")
    rows, nb, ql, h, d = q.shape
    has_prefix = k_cache is not None
    has_block = k_blk is not None
    if not has_prefix and not has_block:
        raise ValueError("k_cache / k_blk: give the prefix arguments, the block arguments or both")
    if has_prefix:
        if v_cache is None or block_table is None or prefix_lens is None:
            raise ValueError("v_cache, block_table, prefix_lens: required with k_cache")
        _check_prefix(q, k_cache, v_cache, block_table, prefix_lens, prefix_visible, validate)
    elif prefix_visible is not None:
        raise ValueError("prefix_visible: only meaningful with k_cache")
    if has_block:
        if v_blk is None:
            raise ValueError("v_blk: required with k_blk")
        _check_block(q, k_blk, v_blk, blk_mask)
    elif blk_mask is not None:
        raise ValueError("blk_mask: only meaningful with k_blk")
    kvh = k_cache.shape[2] if has_prefix else k_blk.shape[3]
    if has_prefix and has_block and k_blk.shape[3] != kvh:
        raise ValueError(f"k_blk: kv_heads {k_blk.shape[3]} differs from k_cache's {kvh}")
    scale = d ** -0.5 if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: must be a positive finite number, got {scale}")
    g = h // kvh
    total = nb * ql * g
    gpu = q.device.type == "cuda"
    bm = block_m or max(16, min(64 if gpu else 16, next_pow2(total)))
    bn = block_n or (64 if gpu else 16)
    programs = triton.cdiv(total, bm) * rows * kvh
    cap = block_table.shape[1] * k_cache.shape[1] if has_prefix else 0
    ns = num_splits or _auto_splits(q, programs, cap, bn)
    if ns < 1:
        raise ValueError(f"num_splits: must be >= 1, got {ns}")
    if split_tokens is not None and (split_tokens < 1 or split_tokens % bn
                                     or split_tokens * ns < cap):
        raise ValueError(f"split_tokens: must be a positive multiple of block_n ({bn}) with "
                         f"num_splits ({ns}) x split_tokens >= the prefix capacity ({cap}), "
                         f"got {split_tokens}")
    dev = q.device
    if ns == 1:
        out = torch.empty(rows, nb, ql, h, d, dtype=out_dtype or q.dtype, device=dev)
        m = l_ = out  # placeholders when no state is asked for
        if return_state:
            m = torch.empty(rows, nb, ql, h, dtype=torch.float32, device=dev)
            l_ = torch.empty(rows, nb, ql, h, dtype=torch.float32, device=dev)
    else:  # fp32 partials per split, merged below
        out = torch.empty(ns, rows, nb, ql, h, d, dtype=torch.float32, device=dev)
        m = torch.empty(ns, rows, nb, ql, h, dtype=torch.float32, device=dev)
        l_ = torch.empty(ns, rows, nb, ql, h, dtype=torch.float32, device=dev)
    z = (0,) * 4
    kc, vc = (k_cache, v_cache) if has_prefix else (q, q)
    bt = block_table if has_prefix else out
    kb, vb = (k_blk, v_blk) if has_block else (q, q)
    if has_block and kb.stride() != vb.stride():  # one set of strides for both (a small copy)
        kb, vb = kb.contiguous(), vb.contiguous()
    mask = blk_mask.view(torch.int8) if blk_mask is not None else out
    sm = ((blk_mask.stride(0) if blk_mask.dim() == 4 else 0, *blk_mask.stride()[-3:-1])
          if blk_mask is not None else (0, 0, 0))
    so = out.stride()[-5:-1]
    if total and rows:
        _branch_attn_kernel[(triton.cdiv(total, bm), rows * kvh, ns)](
            q, kc, vc, bt, prefix_lens if has_prefix else out,
            prefix_visible if prefix_visible is not None else out, kb, vb, mask, out, m, l_,
            *q.stride()[:4], *(kc.stride()[:3] if has_prefix else z[:3]),
            bt.stride(0) if has_prefix else 0, *(kb.stride()[:4] if has_block else z),
            *sm, *so, out.stride(0) if ns > 1 else 0, m.stride(0) if ns > 1 else 0,
            nb, ql, k_blk.shape[2] if has_block else 0, kvh, ns, split_tokens or 0,
            scale * _LOG2E,
            G=g, D=d, PS=k_cache.shape[1] if has_prefix else 1, HAS_PREFIX=has_prefix,
            HAS_PVIS=prefix_visible is not None, HAS_BLOCK=has_block,
            HAS_MASK=blk_mask is not None, STATE=return_state or ns > 1,
            PREC="ieee" if q.dtype == torch.float32 or not gpu else "tf32", BM=bm, BN=bn,
            CPU=not gpu, BD=next_pow2(max(d, 16)))
    if ns > 1:
        return merge_partials(out, m, l_, dtype=out_dtype or q.dtype, return_state=return_state)
    return (out, m, l_) if return_state else out


def _auto_splits(q, programs: int, cap_tokens: int, bn: int) -> int:
    """Split the prefix until about two programs per SM run (GPU only), >= 4 key tiles each."""
    if q.device.type != "cuda" or not cap_tokens or not programs:
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(-(-2 * sms // programs), 16, cap_tokens // (4 * bn)))
