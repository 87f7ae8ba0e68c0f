"""Ragged prefix attention of *packed* query rows (SpecFold's batch-wide compaction; spec:
reference.packed_attention).

Packed rows: the query rows of many requests in one buffer q [rows, heads, dim]; `row_request[i]`
is the request whose paged prefix row i attends to (all prefix_lens[request] tokens), -1 = an
unused row (out 0, m -inf, l 0: written, never left as it was). Optionally each row also attends
to one own block of keys, `row_block[i]` of k_blk [blocks, blk_len, kv_heads, dim], under a
per-row mask [rows, blk_len]. A tile of rows loops over the requests (blocks) it holds, so rows
of one request should lie next to each other (compaction keeps them ascending): mixing costs
time, never correctness. A static prefix [requests, len, kv_heads, dim] is pages of size len
with block_table [[0], [1], ...]. State (m, l) and split-K as in attention.py.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor, next_pow2
from .attention import _LOG2E, _auto_splits, _online_step, _tile_scores, check_paged_cache
from .merge import merge_partials

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32,)


@triton.jit
def _packed_attn_kernel(
        q_ptr, req_ptr, kc_ptr, vc_ptr, bt_ptr, plen_ptr, rb_ptr, kb_ptr, vb_ptr, mask_ptr,
        out_ptr, m_ptr, l_ptr,
        sq_r, sq_h, sc_p, sc_s, sc_h, sbt_r, sb_b, sb_t, sb_h, sm_r, so_s, ss_s,
        ROWS, H, BL, NS, qk_scale,
        G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, HAS_PREFIX: tl.constexpr,
        HAS_BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
        CPU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    kvh = tl.program_id(1)
    split = tl.program_id(2)  # split-K over each request's prefix; the last also takes blocks
    t = tl.program_id(0) * BM + tl.arange(0, BM)  # (packed row, head in group)
    i = t // G
    t_ok = i < ROWS
    head = kvh * G + t % G
    d = tl.arange(0, BD)
    d_ok = d < D
    q = tl.load(q_ptr + i.to(tl.int64)[:, None] * sq_r + head[:, None] * sq_h + d[None, :],
                mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    zero64 = tl.full([], 0, tl.int64)  # 64-bit offsets (loop indices may be plain ints)
    if HAS_PREFIX:
        req = tl.load(req_ptr + i, mask=t_ok, other=-1)
        live = req >= 0
        r_lo = tl.min(tl.where(live, req, 2147483647), 0)
        r_hi = tl.max(tl.where(live, req, -1), 0)
        for r in range(r_lo, r_hi + 1):  # empty when the tile holds no live row
            plen = tl.load(plen_ptr + r)
            mine = req == r
            per = tl.cdiv(tl.cdiv(plen, BN), NS) * BN
            for j0 in range(split * per, tl.minimum(plen, split * per + per), BN):
                j = j0 + tl.arange(0, BN)
                j_ok = j < plen
                page = tl.load(bt_ptr + (zero64 + r) * sbt_r + j // PS, mask=j_ok,
                               other=0).to(tl.int64)
                kv_off = page * sc_p + (j % PS) * sc_s + kvh * sc_h
                kv_mask = j_ok[:, None] & d_ok[None, :]
                s, v = _tile_scores(q, kc_ptr, vc_ptr, kv_off, kv_mask, d, qk_scale, CPU,
                                    PREC)
                s = tl.where(mine[:, None] & j_ok[None, :], s, float("-inf"))
                acc, m_i, l_i = _online_step(acc, m_i, l_i, s, v, PREC, CPU)
    if HAS_BLOCK:
        blk = tl.load(rb_ptr + i, mask=t_ok, other=-1)
        has = blk >= 0
        b_lo = tl.min(tl.where(has, blk, 2147483647), 0)
        b_hi = tl.where(split == NS - 1, tl.max(tl.where(has, blk, -1), 0), -1)
        for b in range(b_lo, b_hi + 1):
            mine = blk == b
            for u0 in range(0, BL, BN):
                u = u0 + tl.arange(0, BN)
                u_ok = u < BL
                kv_off = (zero64 + b) * sb_b + u * sb_t + kvh * sb_h
                kv_mask = u_ok[:, None] & d_ok[None, :]
                s, v = _tile_scores(q, kb_ptr, vb_ptr, kv_off, kv_mask, d, qk_scale, CPU,
                                    PREC)
                vis = mine[:, None] & u_ok[None, :]
                if HAS_MASK:
                    mk = tl.load(mask_ptr + i.to(tl.int64)[:, None] * sm_r + u[None, :],
                                 mask=vis, other=0)
                    vis = vis & (mk != 0)
                s = tl.where(vis, s, float("-inf"))
                acc, m_i, l_i = _online_step(acc, m_i, l_i, s, v, PREC, CPU)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    row_head = i.to(tl.int64) * H + head  # flat (row, head)
    tl.store(out_ptr + split.to(tl.int64) * so_s + row_head[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])
    tl.store(m_ptr + split.to(tl.int64) * ss_s + row_head, m_i * 0.6931471805599453, mask=t_ok)
    tl.store(l_ptr + split.to(tl.int64) * ss_s + row_head, l_i, mask=t_ok)


def _check_prefix(q, row_request, k_cache, v_cache, block_table, prefix_lens, validate):
    h, d = q.shape[1:]
    check_tensor("row_request", row_request, 1, _INTS, q.device)
    check_shape("row_request", row_request, (q.shape[0],))
    if validate:  # a host read (sync on GPU)
        reqs = block_table.shape[0]
        if bool(((row_request < -1) | (row_request >= reqs)).any()):
            raise ValueError(f"row_request: entries must lie in [-1, {reqs}) (block_table rows)")
    _, ps, kvh = check_paged_cache(q, h, d, k_cache, v_cache, block_table, prefix_lens, validate)
    return kvh, ps


def _check_block(q, k_blk, v_blk, row_block, blk_mask, validate):
    d = q.shape[2]
    for name, t in (("k_blk", k_blk), ("v_blk", v_blk)):
        check_tensor(name, t, 4, (q.dtype,), q.device, contiguous=False, last_contiguous=True)
        check_shape(name, t, (None, None, None, d))
    check_shape("v_blk", v_blk, tuple(k_blk.shape))
    if q.shape[1] % k_blk.shape[2]:
        raise ValueError(f"k_blk: kv_heads {k_blk.shape[2]} must divide the {q.shape[1]} heads")
    if row_block is None:
        raise ValueError("row_block: required with k_blk")
    check_tensor("row_block", row_block, 1, _INTS, q.device)
    check_shape("row_block", row_block, (q.shape[0],))
    if blk_mask is not None:
        check_tensor("blk_mask", blk_mask, 2, (torch.bool,), q.device, contiguous=False,
                     last_contiguous=True)
        check_shape("blk_mask", blk_mask, (q.shape[0], k_blk.shape[1]))
    if validate and bool(((row_block < -1) | (row_block >= k_blk.shape[0])).any()):
        raise ValueError(f"row_block: entries must lie in [-1, {k_blk.shape[0]})")


def packed_attention(
    q,  # [rows, heads, dim] packed query rows
    row_request=None,  # [rows] int32 request of each row (-1 = unused row)
    k_cache=None,  # [pages, page_size, kv_heads, dim] paged prefixes of all requests
    v_cache=None,  # [pages, page_size, kv_heads, dim]
    block_table=None,  # [requests, max_pages] int32
    prefix_lens=None,  # [requests] int32
    k_blk=None,  # [blocks, blk_len, kv_heads, dim] own-block keys
    v_blk=None,  # [blocks, blk_len, kv_heads, dim]
    row_block=None,  # [rows] int32 own block of each row (-1 = none)
    blk_mask=None,  # [rows, blk_len] bool, True = visible; None = the whole block
    scale: float | None = None,  # default 1/sqrt(dim)
    validate: bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,  # split-K over each prefix; None = auto (1 on CPU)
    out_dtype: torch.dtype | None = torch.float32,  # default fp32: partials for a merge
):
    """Returns out [rows, heads, dim] (out_dtype; None = q.dtype) and m, l [rows, heads] fp32
    (module docstring). Give the prefix arguments, the block arguments, or both."""
    check_tensor("q", q, 3, _FLOATS, contiguous=False, last_contiguous=True)
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise ValueError(f"out_dtype: {out_dtype} not allowed (float32, float16, bfloat16)")
    rows, h, d = q.shape
    has_prefix, has_block = k_cache is not None, k_blk is not None
    if not has_prefix and not has_block:
        raise ValueError("k_cache / k_blk: give the prefix arguments, the block arguments or both")
    kvh, ps = None, 1
    if has_prefix:
        if None in (v_cache, block_table, prefix_lens, row_request):
            raise ValueError("v_cache, block_table, prefix_lens, row_request: required with "
                             "k_cache")
        kvh, ps = _check_prefix(q, row_request, k_cache, v_cache, block_table, prefix_lens,
                                validate)
    if has_block:
        if v_blk is None:
            raise ValueError("v_blk: required with k_blk")
        _check_block(q, k_blk, v_blk, row_block, blk_mask, validate)
        if kvh is not None and k_blk.shape[2] != kvh:
            raise ValueError(f"k_blk: kv_heads {k_blk.shape[2]} differs from k_cache's {kvh}")
        kvh = k_blk.shape[2]
    elif blk_mask is not None or row_block is not None:
        raise ValueError("row_block / blk_mask: only meaningful with k_blk")
    scale = d ** -0.5 if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: must be a positive finite number, got {scale}")
    g = h // kvh
    gpu = q.device.type == "cuda"
    bm = block_m or max(16, min(64 if gpu else 128, next_pow2(rows * g)))
    bn = block_n or 64
    programs = triton.cdiv(rows * g, bm) * kvh
    cap = block_table.shape[1] * ps if has_prefix else 0
    ns = num_splits or _auto_splits(q, programs, cap, bn)
    if ns < 1:
        raise ValueError(f"num_splits: must be >= 1, got {ns}")
    dev, f32 = q.device, torch.float32
    dtype = out_dtype or q.dtype
    out = torch.empty(ns, rows, h, d, dtype=dtype if ns == 1 else f32, device=dev)
    m = torch.empty(ns, rows, h, dtype=f32, device=dev)
    l_ = torch.empty(ns, rows, h, dtype=f32, device=dev)
    z = (0,) * 4
    kc, vc = (k_cache, v_cache) if has_prefix else (q, q)
    kb, vb = (k_blk, v_blk) if has_block else (q, q)
    if rows:
        _packed_attn_kernel[(triton.cdiv(rows * g, bm), kvh, ns)](
            q, row_request if has_prefix else m, kc, vc, block_table if has_prefix else m,
            prefix_lens if has_prefix else m, row_block if has_block else m, kb, vb,
            blk_mask.view(torch.int8) if blk_mask is not None else m, out, m, l_,
            q.stride(0), q.stride(1), *(kc.stride()[:3] if has_prefix else z[:3]),
            block_table.stride(0) if has_prefix else 0, *(kb.stride()[:3] if has_block else
                                                         z[:3]),
            blk_mask.stride(0) if blk_mask is not None else 0, out.stride(0), m.stride(0),
            rows, h, k_blk.shape[1] if has_block else 0, ns, scale * _LOG2E,
            G=g, D=d, PS=ps, HAS_PREFIX=has_prefix, HAS_BLOCK=has_block,
            HAS_MASK=blk_mask is not None,
            PREC="ieee" if q.dtype == torch.float32 or not gpu else "tf32",
            CPU=not gpu, BM=bm, BN=bn, BD=next_pow2(max(d, 16)))
    if ns > 1:
        return merge_partials(out, m, l_, dtype=dtype, return_state=True)
    return out[0], m[0], l_[0]
