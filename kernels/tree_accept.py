"""The greedy acceptance of a tree round in one kernel (Triton; spec: `reference.tree_accept`).

After the target's verify, each request walks its tree from the root: at every depth it follows
the child whose draft token is the target's argmax at the current node (siblings carry distinct
tokens, so at most one matches) and stops where none does. What follows from the path comes out
of the same program: the tokens the scheduler commits (the target's token after each path node,
the last one the bonus), the path's length, and the KV move pairs (the path's slots onto the
front slots of the verify block). In torch that is about 40 launches (`reference.tree_accept`);
here it is one program per request, D sequential steps over a W-wide vector. Nothing syncs with
the host (CUDA-graph friendly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_rows, check_tensor, next_pow2


@triton.jit
def _tree_accept_kernel(choice_ptr, draft_ptr, par_ptr, loc_ptr, live_ptr,
                        predict_ptr, path_ptr, n_ptr, bonus_ptr, tgt_ptr, src_ptr,
                        W: tl.constexpr, D: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BW)
    inb = offs < W
    par = tl.load(par_ptr + row * W + offs, mask=inb, other=-1)
    draft = tl.load(draft_ptr + row * W + offs, mask=inb, other=-1)
    at = tl.arange(0, BD)  # depth 0..D
    alive = tl.load(live_ptr + row).to(tl.int32)
    cur = 0  # the walk's node
    want = tl.load(choice_ptr + row * W)  # the target's token after it
    path = tl.zeros([BD], dtype=tl.int64)
    tok = tl.where(at == 0, want, 0) * alive
    n = alive
    for d in tl.static_range(1, D + 1):
        match = inb & (offs > 0) & (par == cur) & (draft == want) & (n == d)
        child = tl.max(tl.where(match, offs, -1), 0)
        found = child >= 0
        cur = tl.where(found, child, cur)
        want = tl.load(choice_ptr + row * W + cur)
        path = tl.where((at == d) & found, child, path)
        tok = tl.where((at == d) & found, want, tok)
        n = n + found.to(tl.int32)
    on = at < n
    tl.store(predict_ptr + row * W + offs, tl.zeros([BW], dtype=tl.int32), mask=inb)
    tl.debug_barrier()
    tl.store(predict_ptr + row * W + at, tok.to(tl.int32), mask=at <= D)
    tl.store(path_ptr + row * (D + 1) + at, path, mask=at <= D)
    tl.store(n_ptr + row, n)
    tl.store(bonus_ptr + row, tl.sum(tl.where(at == n - 1, tok, 0), 0).to(tl.int64))
    front = tl.load(loc_ptr + row * W + at, mask=on & (at <= D), other=0)
    moved = tl.load(loc_ptr + row * W + path, mask=on & (at <= D), other=0)
    tl.store(tgt_ptr + row * (D + 1) + at, front, mask=at <= D)
    tl.store(src_ptr + row * (D + 1) + at, moved, mask=at <= D)


def tree_accept(choice: torch.Tensor,  # [b, W] int64 the target's argmax at every tree index
                draft: torch.Tensor,  # [b, W] int64 root, then the nodes' draft tokens
                parents: torch.Tensor,  # [b, W] int64 tree index of each parent (root: 0)
                loc: torch.Tensor,  # [b, W] int64 the verify's KV slot of every tree index
                live: torch.Tensor,  # [b] bool, False for padded rows
                depth: int,  # D, with D + 1 <= W
                ):
    """(predict [b, W] int32, path [b, D+1] int64, n [b] int32, bonus [b] int64, tgt, src
    [b, D+1] int64): `reference.tree_accept`'s outputs (its depths are not needed here)."""
    check_tensor("choice", choice, dims=2, dtypes=(torch.int64,))
    b, w = choice.shape
    check_rows((("draft", draft), ("parents", parents), ("loc", loc)), (b, w), torch.int64,
               choice.device)
    check_rows((("live", live),), (b,), torch.bool, choice.device)
    if not 1 <= depth <= w - 1:
        raise ValueError(f"depth: must be in 1..{w - 1} (W - 1), got {depth}")
    dev, d1 = choice.device, depth + 1
    predict = torch.empty(b, w, dtype=torch.int32, device=dev)
    path, tgt, src = (torch.empty(b, d1, dtype=torch.int64, device=dev) for _ in range(3))
    n = torch.empty(b, dtype=torch.int32, device=dev)
    bonus = torch.empty(b, dtype=torch.int64, device=dev)
    if b:
        _tree_accept_kernel[(b,)](choice, draft, parents, loc, live, predict, path, n, bonus,
                                  tgt, src, W=w, D=depth, BW=next_pow2(w), BD=next_pow2(d1),
                                  num_warps=1)
    return predict, path, n, bonus, tgt, src
