"""The token tree of a draft block in one kernel (Triton; spec: `reference.tree_build`,
`reference.tree_tensors`).

A tree round builds, per request, the `budget` most probable prefixes under the drafter's
per-depth top-K log-probs: a beam over depths (the top w_d = min(budget, K^d) children of the
previous beam), then the top `budget` of every depth's beam, in (depth, rank) order. In torch
that is about 8 launches per depth plus 20 (about 140 for 15 depths); here it is one program per
request. Each depth sorts its w_(d-1) * K candidates by one int64 key: the score's bits mapped
to a signed order in the high half, the candidate's index reversed in the low half, so a
descending sort is by score and then by index. That is the reference's stable sort, ties
included. The beam lives in a per-request scratch row of global memory, which the program
re-reads with computed indices (Triton has no gather from registers) after a barrier.
`tree_tensors` then lays each tree out for a verify (one program per request: the draft and
positions, the parents and depths root first, first child and next sibling, the
ancestor-or-self mask by walking each node's parents, the FULL mask's tree positions): about
40 launches in torch. Nothing syncs with the host (CUDA-graph friendly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor, next_pow2
from .tree_reference import beam_widths


@triton.jit
def _order_key(score, idx, BLOCK: tl.constexpr):
    """int64 keys whose descending order is (score desc, idx asc); `score` float32."""
    bits = score.to(tl.int32, bitcast=True)
    signed = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed int order
    return (signed.to(tl.int64) << 32) | (BLOCK - 1 - idx).to(tl.int64)


@triton.jit
def _key_score(key):
    signed = (key >> 32).to(tl.int32)
    return (signed ^ ((signed >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _tree_build_kernel(lp_ptr, ids_ptr, tok_ptr, par_ptr, dep_ptr,
                       s_score, s_par, s_tok, s_dep, s_flag,
                       G: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                       BC: tl.constexpr, CB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lp_ptr += row * G * K
    ids_ptr += row * G * K
    s_score += row * CB
    s_par += row * CB
    s_tok += row * CB
    s_dep += row * CB
    s_flag += row * CB
    offs = tl.arange(0, BC)
    parent_beam, kid = offs // K, offs % K
    w_prev = 1
    prev_off = 0  # scratch index of the previous depth's beam
    cur_off = 0  # scratch index of this depth's beam
    for d in tl.static_range(G):
        live = parent_beam < w_prev
        if d == 0:
            base = tl.zeros([BC], dtype=tl.float32)
        else:
            base = tl.load(s_score + prev_off + parent_beam, mask=live, other=0.0)
        lp = tl.load(lp_ptr + d * K + kid, mask=live, other=0.0)
        child = tl.where(live, base + lp + 0.0, float("-inf"))  # + 0.0: no -0.0 (sort order)
        key = tl.sort(_order_key(child, offs, BC), descending=True)
        idx = (BC - 1) - (key & 0xFFFFFFFF).to(tl.int32)  # candidate of each sorted place
        w = tl.minimum(w_prev * K, N)
        keep = offs < w
        tl.store(s_score + cur_off + offs, _key_score(key), mask=keep)
        if d == 0:
            tl.store(s_par + cur_off + offs, tl.full([BC], -1, tl.int32), mask=keep)
        else:
            tl.store(s_par + cur_off + offs, prev_off + idx // K, mask=keep)
        tok = tl.load(ids_ptr + d * K + idx % K, mask=keep, other=0)
        tl.store(s_tok + cur_off + offs, tok.to(tl.int64), mask=keep)
        tl.store(s_dep + cur_off + offs, tl.full([BC], d + 1, tl.int32), mask=keep)
        tl.debug_barrier()
        prev_off = cur_off
        cur_off = cur_off + w
        w_prev = w
    # the top N of every depth's beam, then tree index = rank among the chosen by candidate index
    every = tl.arange(0, CB)
    seen = every < cur_off
    score = tl.load(s_score + every, mask=seen, other=float("-inf"))
    key = tl.sort(_order_key(score, every, CB), descending=True)
    chosen = (CB - 1) - (key & 0xFFFFFFFF).to(tl.int32)
    tl.store(s_flag + chosen, tl.full([CB], 1, tl.int32), mask=every < N)
    tl.debug_barrier()
    flag = tl.load(s_flag + every, mask=seen, other=0)
    tree_index = tl.cumsum(flag, 0) * flag  # 1..N for the chosen, 0 else
    tl.debug_barrier()
    tl.store(s_flag + every, tree_index, mask=seen)
    tl.debug_barrier()
    parent = tl.load(s_par + every, mask=seen, other=-1)
    parent_index = tl.load(s_flag + parent, mask=seen & (parent >= 0), other=0)
    put = flag > 0
    at = row * N + tree_index - 1
    tl.store(tok_ptr + at, tl.load(s_tok + every, mask=put, other=0), mask=put)
    tl.store(par_ptr + at, parent_index.to(tl.int64), mask=put)
    tl.store(dep_ptr + at, tl.load(s_dep + every, mask=put, other=0).to(tl.int64), mask=put)


def tree_build(top_lp: torch.Tensor,  # [batch, g, k] float32 log-probs, best first per depth
               top_ids: torch.Tensor,  # [batch, g, k] int64 their token ids
               budget: int,  # nodes per row, 1..sum(beam_widths(g, k, budget))
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [batch, budget] int64 x3
    """Tokens, parents (tree indices, 0 = anchor) and depths (1..g) of every row's tree; the
    same tensors as `reference.tree_build`."""
    check_tensor("top_lp", top_lp, dims=3, dtypes=(torch.float32,))
    b, g, k = top_lp.shape
    check_tensor("top_ids", top_ids, dims=3, dtypes=(torch.int64,), device=top_lp.device)
    check_shape("top_ids", top_ids, (b, g, k))
    widths = beam_widths(g, k, budget)
    if not 1 <= budget <= sum(widths):
        raise ValueError(f"budget: must be in 1..{sum(widths)} (the capacity of {g} levels of "
                         f"top-{k}), got {budget}")
    levels, total = len(widths), sum(widths)
    bc = next_pow2(max(widths) * k)  # a depth's candidates: the previous beam times k
    cb = next_pow2(total)  # every depth's beam
    dev = top_lp.device
    out = [torch.empty(b, budget, dtype=torch.int64, device=dev) for _ in range(3)]
    scratch = (torch.empty(b, cb, dtype=torch.float32, device=dev),
               torch.empty(b, cb, dtype=torch.int32, device=dev),
               torch.empty(b, cb, dtype=torch.int64, device=dev),
               torch.empty(b, cb, dtype=torch.int32, device=dev),
               torch.zeros(b, cb, dtype=torch.int32, device=dev))
    if b:
        _tree_build_kernel[(b,)](top_lp, top_ids, *out, *scratch, G=levels, K=k, N=budget,
                                 BC=bc, CB=cb, num_warps=4)
    return out[0], out[1], out[2]


@triton.jit
def _tree_tensors_kernel(tok_ptr, par_ptr, dep_ptr, root_ptr, lens_ptr,
                         draft_ptr, pos_ptr, fpar_ptr, fdep_ptr, index_ptr, nxt_ptr, sib_ptr,
                         anc_ptr, at_ptr, B,
                         N: tl.constexpr, D: tl.constexpr, BW: tl.constexpr, RB: tl.constexpr,
                         BB: tl.constexpr):
    W: tl.constexpr = N + 1
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BW)
    node = cols > 0
    inw = cols < W
    src = node & inw  # the nodes' own entries (tree index - 1)
    par = tl.load(par_ptr + row * N + cols - 1, mask=src, other=0).to(tl.int64)
    dep = tl.load(dep_ptr + row * N + cols - 1, mask=src, other=0).to(tl.int64)
    tok = tl.load(tok_ptr + row * N + cols - 1, mask=src, other=0).to(tl.int64)
    tok = tl.where(node, tok, tl.load(root_ptr + row).to(tl.int64))
    length = tl.load(lens_ptr + row).to(tl.int64)
    out = row * W + cols
    tl.store(draft_ptr + out, tok, mask=inw)
    tl.store(pos_ptr + out, length + dep, mask=inw)
    tl.store(fpar_ptr + out, par, mask=inw)
    tl.store(fdep_ptr + out, dep, mask=inw)
    tl.store(index_ptr + out, out, mask=inw)
    before = row * 0  # the lengths of the rows before this one, summed in chunks of BB
    for r0 in range(0, B, BB):
        rows = r0 + tl.arange(0, BB)
        before += tl.sum(tl.load(lens_ptr + rows, mask=rows < row, other=0).to(tl.int64), 0)
    start = W * before + row * W * W  # the FULL mask's first entry of this request
    tl.debug_barrier()  # the parents just stored are read back by index below
    for i0 in tl.static_range(0, BW, RB):
        i = i0 + tl.arange(0, RB)
        ini = i < W
        mine = tl.load(fpar_ptr + row * W + i, mask=ini, other=-1)
        kids = (par[None, :] == i[:, None]) & src[None, :]
        first = tl.min(tl.where(kids, cols[None, :], W), 1)
        tl.store(nxt_ptr + row * W + i, tl.where(first < W, first, -1).to(tl.int64), mask=ini)
        later = ((par[None, :] == mine[:, None]) & src[None, :] & (cols[None, :] > i[:, None])
                 & (i[:, None] > 0))
        nsib = tl.min(tl.where(later, cols[None, :], W), 1)
        tl.store(sib_ptr + row * W + i, tl.where(nsib < W, nsib, -1).to(tl.int64), mask=ini)
        anc = cols[None, :] == i[:, None]
        up = tl.where(ini, i, 0)
        for _ in tl.static_range(D):
            up = tl.load(fpar_ptr + row * W + up, mask=ini, other=0)
            anc = anc | (cols[None, :] == up[:, None])
        tile = row * W * W + i[:, None] * W + cols[None, :]
        both = ini[:, None] & inw[None, :]
        tl.store(anc_ptr + tile, anc, mask=both)
        at = start + i[:, None].to(tl.int64) * (length + W) + length + cols[None, :]
        tl.store(at_ptr + tile, at, mask=both)


def tree_tensors(tokens: torch.Tensor,  # [b, N] int64 draft tokens in tree order
                 parents: torch.Tensor,  # [b, N] int64 tree index of each parent (0 = root)
                 depths: torch.Tensor,  # [b, N] int64 1..D
                 root: torch.Tensor,  # [b] int64 the root's token
                 seq_lens: torch.Tensor,  # [b] int32 / int64 committed prefix lengths
                 depth: int,  # D
                 ):
    """`reference.tree_tensors`'s outputs (draft, positions, parents, depths, index, first
    child, next sibling [b, W] int64; ancestor-or-self [b, W, W] bool; FULL mask positions
    [b, W, W] int64) in one program per row."""
    check_tensor("tokens", tokens, dims=2, dtypes=(torch.int64,))
    b, n = tokens.shape
    for name, t in (("parents", parents), ("depths", depths)):
        check_tensor(name, t, dims=2, dtypes=(torch.int64,), device=tokens.device)
        check_shape(name, t, (b, n))
    check_tensor("root", root, dims=1, dtypes=(torch.int64,), device=tokens.device)
    check_tensor("seq_lens", seq_lens, dims=1, dtypes=(torch.int32, torch.int64),
                 device=tokens.device)
    check_shape("root", root, (b,))
    check_shape("seq_lens", seq_lens, (b,))
    if depth < 1:
        raise ValueError(f"depth: must be >= 1, got {depth}")
    w, dev = n + 1, tokens.device
    flat = [torch.empty(b, w, dtype=torch.int64, device=dev) for _ in range(7)]
    anc = torch.empty(b, w, w, dtype=torch.bool, device=dev)
    at = torch.empty(b, w, w, dtype=torch.int64, device=dev)
    if b:
        bw = next_pow2(w)
        _tree_tensors_kernel[(b,)](tokens, parents, depths, root, seq_lens, *flat, anc, at, b,
                                   N=n, D=depth, BW=bw, RB=min(bw, 16), BB=64, num_warps=4)
    draft, pos, par, dep, index, nxt, sib = flat
    return draft, pos, par, dep, index, nxt, sib, anc, at
