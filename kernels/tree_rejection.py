"""Recursive rejection sampling down a token tree in one kernel (Triton; spec:
`reference.tree_rejection`).

One program per request walks its tree from the root. At a node it tries the children in rank
order against the residual r (at first the target's p there) and the proposal s (the drafter's
q at the next depth, with the rejected siblings taken out): child x is kept when u * s(x) < r(x).
Only a rejection reads the vocabulary: one pass writes max(r - s, 0) to a scratch row and sums
it (r is kept unnormalised, with its total; s is q scaled by 1 / (1 - the rejected siblings' q),
those siblings masked). A kept child costs two scalar loads. So a round reads the vocabulary
once per rejection plus twice for the bonus (the total, then the inverse CDF in fp64), where the
torch reference runs D x K full steps (about 800 small kernels at 32 nodes, top-4). Nothing
syncs with the host (CUDA-graph friendly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_rows, check_tensor, next_pow2


@triton.jit
def _residual(p_ptr, ws_ptr, q_ptr, src_in_ws, p_off, ws_src, ws_dst, mass, scale, rm, V,
              BLOCK: tl.constexpr):
    """max(r - s, 0) over the vocabulary into the scratch row `ws_dst`; returns its sum."""
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        in_p = m & ((offs * 0 + src_in_ws) == 0)  # the scalar broadcast first (the interpreter)
        r = (tl.load(p_ptr + p_off + offs, mask=in_p, other=0.0)
             + tl.load(ws_ptr + ws_src + offs, mask=m & ~in_p, other=0.0)) / mass
        s = tl.load(q_ptr + offs, mask=m, other=0.0) * scale
        out = tl.sum((offs[:, None] == rm[None, :]).to(tl.int32), 1) > 0
        res = tl.maximum(r - tl.where(out, 0.0, s), 0.0)
        tl.store(ws_ptr + ws_dst + offs, res, mask=m)
        total += res
    return tl.sum(total, 0)


@triton.jit
def _tree_rejection_kernel(p_ptr, q_ptr, draft_ptr, par_ptr, u_ptr, ub_ptr, ws_ptr,
                           path_ptr, acc_ptr, bonus_ptr, V,
                           W: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                           BW: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BW)
    inb = offs < W
    par = tl.load(par_ptr + row * W + offs, mask=inb, other=-1)
    draft = tl.load(draft_ptr + row * W + offs, mask=inb, other=-1)
    at = tl.arange(0, BD)
    ks = tl.arange(0, BK)
    path = tl.zeros([BD], dtype=tl.int64)
    cur = row * 0  # the walk's node (int64)
    alive = row * 0 + 1
    acc = row * 0
    src_in_ws = row * 0  # r is p at `cur` (0) or the scratch row `slot` (1)
    slot = row * 0
    mass = tl.full([], 1.0, dtype=tl.float32)  # r's total (p rows: 1)
    ws_row = row * 2 * V
    for j in tl.static_range(D):
        if alive != 0:
            q_row = q_ptr + (row * D + j) * V
            scale = tl.full([], 1.0, dtype=tl.float32)
            out_q = tl.full([], 0.0, dtype=tl.float32)  # q of the rejected siblings
            rm = tl.full([BK], -1, dtype=tl.int64)
            moved = row * 0
            stop = row * 0
            match = inb & (offs > 0) & (par == cur)
            rank = tl.cumsum(match.to(tl.int32), 0)
            for i in tl.static_range(K):
                c = tl.max(tl.where(match & (rank == i + 1), offs, 0), 0).to(tl.int64)
                if (moved == 0) & (stop == 0) & (c > 0):
                    x = tl.sum(tl.where(offs == c, draft, 0), 0)
                    qx = tl.load(q_row + x)
                    sx = qx * scale
                    if sx <= 0.0:
                        stop = row * 0 + 1
                    else:
                        rx = tl.where(src_in_ws == 0, tl.load(p_ptr + (row * W + cur) * V + x),
                                      tl.load(ws_ptr + ws_row + slot * V + x)) / mass
                        if tl.load(u_ptr + (row * D + j) * K + i) * sx < rx:
                            moved = row * 0 + 1
                            cur = c
                        else:
                            dst = tl.where(src_in_ws != 0, 1 - slot, 0)
                            got = _residual(p_ptr, ws_ptr, q_row, src_in_ws,
                                            (row * W + cur) * V, ws_row + slot * V,
                                            ws_row + dst * V, mass, scale, rm, V, BLOCK)
                            if got > 0.0:
                                src_in_ws = row * 0 + 1
                                slot = dst
                                mass = got
                            rm = tl.where(ks == i, x, rm)
                            out_q += qx
                            scale = 1.0 / (1.0 - out_q)
            if moved != 0:
                acc += 1
                path = tl.where(at == j + 1, cur, path)
                src_in_ws = row * 0
                mass = tl.full([], 1.0, dtype=tl.float32)
            else:
                alive = row * 0
    # the bonus: inverse CDF of r in fp64 (its total first)
    p_off = (row * W + cur) * V
    ws_src = ws_row + slot * V
    total = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, V, BLOCK):
        vo = start + tl.arange(0, BLOCK)
        m = vo < V
        in_p = m & ((vo * 0 + src_in_ws) == 0)
        total += (tl.load(p_ptr + p_off + vo, mask=in_p, other=0.0)
                  + tl.load(ws_ptr + ws_src + vo, mask=m & ~in_p, other=0.0)).to(tl.float64)
    want = tl.load(ub_ptr + row).to(tl.float64) * tl.sum(total, 0)
    run = tl.full([], 0.0, dtype=tl.float64)
    first = row * 0 + V
    last = row * 0
    for start in range(0, V, BLOCK):
        vo = start + tl.arange(0, BLOCK)
        m = vo < V
        in_p = m & ((vo * 0 + src_in_ws) == 0)
        r = (tl.load(p_ptr + p_off + vo, mask=in_p, other=0.0)
             + tl.load(ws_ptr + ws_src + vo, mask=m & ~in_p, other=0.0))
        cdf = run + tl.cumsum(r.to(tl.float64), 0)
        first = tl.minimum(first, tl.min(tl.where(m & (cdf > want), vo, V), 0))
        last = tl.maximum(last, tl.max(tl.where(m & (r > 0.0), vo, 0), 0))
        run += tl.sum(r.to(tl.float64), 0)
    tl.store(path_ptr + row * (D + 1) + at, path, mask=at <= D)
    tl.store(acc_ptr + row, acc)
    tl.store(bonus_ptr + row, tl.where(first < V, first, last))


def tree_rejection(p: torch.Tensor,  # [b, W, V] fp32 the target's probabilities per tree index
                   q: torch.Tensor,  # [b, D, V] fp32 the drafter's probabilities, depths 1..D
                   draft: torch.Tensor,  # [b, W] int64 root, then the nodes' draft tokens
                   parents: torch.Tensor,  # [b, W] int64 tree index of each parent (root: 0)
                   u: torch.Tensor,  # [b, D, K] fp32 uniforms: the trials
                   u_bonus: torch.Tensor,  # [b] fp32 uniforms: the bonus
                   ):
    """(path [b, D + 1] int64, accepted [b] int64, bonus [b] int64):
    `reference.tree_rejection`'s outputs."""
    check_tensor("p", p, dims=3, dtypes=(torch.float32,))
    b, w, v = p.shape
    check_tensor("u", u, dims=3, dtypes=(torch.float32,), device=p.device)
    depth, k = int(u.shape[1]), int(u.shape[2])
    check_rows((("q", q),), (b, depth, v), torch.float32, p.device)
    check_rows((("draft", draft), ("parents", parents)), (b, w), torch.int64, p.device)
    check_rows((("u_bonus", u_bonus),), (b,), torch.float32, p.device)
    if not 1 <= depth <= w - 1:
        raise ValueError(f"u: its depth must be in 1..{w - 1} (W - 1), got {depth}")
    if k < 1:
        raise ValueError(f"u: its children per node must be >= 1, got {k}")
    dev = p.device
    path = torch.empty(b, depth + 1, dtype=torch.int64, device=dev)
    accepted = torch.empty(b, dtype=torch.int64, device=dev)
    bonus = torch.empty(b, dtype=torch.int64, device=dev)
    ws = torch.empty(b, 2, v, dtype=torch.float32, device=dev)  # the residual's scratch rows
    if b:
        _tree_rejection_kernel[(b,)](
            p, q, draft, parents, u, u_bonus, ws, path, accepted, bonus, v,
            W=w, D=depth, K=k, BW=next_pow2(w), BD=next_pow2(depth + 1), BK=next_pow2(k),
            BLOCK=min(2048, next_pow2(v)), num_warps=8)
    return path, accepted, bonus
