"""Pure-torch references (the spec) for every op in `kernels`.

Terms. A *branch* is one draft sequence; `parent[i]` is the branch it was derived from (-1 = root).
*rho* = ||H_i[n] - H_par(i)[n]|| / ||H_par(i)[n]||; a position is *folded* when rho <= delta (roots
never are). A folded position reuses the projections of its *source*: the nearest non-folded
ancestor at the same position. *Compaction* packs the recomputed (non-folded) rows into one dense
batch; `slot[r]` is where row r's values live in that batch. Attention *state* (m, l): m = max of
the scaled scores s = scale * q.k (natural-log units), l = sum exp(s - m); no visible key gives
out = 0, m = -inf, l = 0.
"""

from __future__ import annotations

import math

import torch

from .tree_reference import (  # noqa: F401 (the token-tree ops live there)
    ancestor_mask,
    beam_widths,
    child_table,
    doubling_steps,
    full_parents,
    greedy_path,
    mask_positions,
    path_outputs,
    tree_accept,
    tree_build,
    tree_links,
    tree_rejection,
    tree_tensors,
)


def gate(hidden: torch.Tensor, parent: torch.Tensor, delta: float, eps: float = 1e-12):
    """Residual ratio and folded mask. rho is +inf for roots.

    hidden,  # [branches, positions, dim]
    parent,  # [branches] int, -1 = root, else an index < branch
    returns rho [branches, positions] fp32, folded [branches, positions] bool."""
    h = hidden.float()
    root = parent < 0
    par = h[parent.clamp(min=0).long()]
    num = (h - par).norm(dim=-1)
    den = par.norm(dim=-1)
    rho = num / den.clamp(min=eps)
    rho = torch.where(root[:, None], torch.full_like(rho, math.inf), rho)
    return rho, rho <= delta


def resolve_sources(folded: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """Flat row (branch * positions + n) of each position's source.

    folded,  # [branches, positions] bool (roots never folded)
    parent,  # [branches] int
    returns [branches, positions] int32."""
    nb, n = folded.shape
    dev = folded.device
    cur = torch.arange(nb, device=dev)[:, None].expand(nb, n).clone()
    pos = torch.arange(n, device=dev)[None].expand(nb, n)
    for _ in range(nb):
        par = parent.long()[cur]
        cur = torch.where(folded[cur, pos] & (par >= 0), par, cur)
    return (cur * n + pos).to(torch.int32)


def compact(src: torch.Tensor, segments: int = 1, capacity: int | None = None):
    """Dense batch of the recomputed rows, per segment (equal groups of branches: requests).

    src,  # [branches, positions] int32 from resolve_sources
    returns rows [segments * capacity] int32 (each segment's recomputed flat rows ascending, the
    first `capacity` of them, then -1), slot [T] int32 (compact index of each row's source, -1
    when the source was dropped), count [segments] int32 (true counts); T = branches * positions,
    capacity defaults to T / segments."""
    flat = src.reshape(-1).long()
    t = flat.numel()
    per = t // segments
    cap = per if capacity is None else capacity
    keep = (flat == torch.arange(t, device=flat.device)).view(segments, per)
    rank = torch.cumsum(keep.long(), 1) - 1  # [segments, per]
    rows = torch.full((segments, cap), -1, dtype=torch.int32, device=flat.device)
    for g in range(segments):
        idx = torch.nonzero(keep[g]).reshape(-1)[:cap] + g * per
        rows[g, : idx.numel()] = idx.to(torch.int32)
    r = rank.reshape(-1)[flat]
    slot = torch.where(r < cap, flat // per * cap + r, -1).to(torch.int32)
    return rows.reshape(-1), slot, keep.sum(1).to(torch.int32)


def compact_batch(src: torch.Tensor, segments: int, capacity: int):
    """One dense batch of the recomputed rows of ALL segments (requests), ascending.

    src,  # [branches, positions] int32 from resolve_sources (sources inside their segment)
    returns rows [capacity] int32 (flat rows, the first `capacity` of them, then -1), slot [T]
    int32 (compact index of each row's source, -1 when dropped), count [segments] int32 (true
    recomputed rows per segment), row_request [capacity] int32 (segment of each compact row,
    -1 for padding); T = branches * positions."""
    flat = src.reshape(-1).long()
    t = flat.numel()
    keep = flat == torch.arange(t, device=flat.device)
    idx = torch.nonzero(keep).reshape(-1)
    rows = torch.full((capacity,), -1, dtype=torch.int32, device=flat.device)
    rows[: min(capacity, idx.numel())] = idx[:capacity].to(torch.int32)
    req = torch.where(rows >= 0, rows // (t // segments), -1).to(torch.int32)
    rank = torch.cumsum(keep.long(), 0) - 1
    r = rank[flat]
    slot = torch.where(r < capacity, r, -1).to(torch.int32)
    return rows, slot, keep.view(segments, -1).sum(1).to(torch.int32), req


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [T, dim], rows [T] (-1 = padding) -> [T, dim]; padding rows are zero."""
    out = x[rows.clamp(min=0).long()].clone()
    out[rows < 0] = 0
    return out


def scatter_rows(y: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """y [M, dim] (compact results), slot [T] -> [T, dim]; folded rows get their source's row."""
    return y[slot.long()].clone()


def fold_plan(hidden: torch.Tensor, parent: torch.Tensor, delta: float = 0.1, segments: int = 1,
              capacity: int | None = None):
    """Reference of specdec_kernels.gate.fold_plan: (rho, folded, src, rows, slot, count)."""
    rho, folded = gate(hidden, parent, delta)
    src = resolve_sources(folded, parent)
    return (rho, folded, src, *compact(src, segments, capacity))


def paged_prefix(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache [pages, page_size, kv_heads, dim], block_table [max_pages]
    -> [length, kv_heads, dim] (a gather: the reference materialises, the kernel does not)."""
    ps = cache.shape[1]
    j = torch.arange(length, device=cache.device)
    return cache[block_table.long()[j // ps], j % ps]


def attention(q, k_cache=None, v_cache=None, block_table=None, prefix_lens=None, k_blk=None,
              v_blk=None, blk_mask=None, prefix_visible=None, scale=None):
    """Reference of specdec_kernels.attention.branch_attention (same arguments, see there).

    Materialises every branch's keys (prefix then own block) and runs a dense fp32 softmax.
    returns out [rows, branches, q_len, heads, dim] (q.dtype),
    m, l [rows, branches, q_len, heads] fp32."""
    rows, nb, ql, h, d = q.shape
    dev = q.device
    scale = d ** -0.5 if scale is None else scale
    outs, ms, ls = [], [], []
    for r in range(rows):
        ks, vs, vis = [], [], []
        if k_cache is not None:
            plen = int(prefix_lens[r])
            kp = paged_prefix(k_cache, block_table[r], plen)  # [plen, kvh, d]
            vp = paged_prefix(v_cache, block_table[r], plen)
            ks.append(kp[None].expand(nb, -1, -1, -1))  # zero-copy view over branches
            vs.append(vp[None].expand(nb, -1, -1, -1))
            pv = torch.full((nb,), plen, device=dev)
            if prefix_visible is not None:
                pv = prefix_visible[r].clamp(max=plen)
            seen = torch.arange(plen, device=dev)[None] < pv[:, None]  # [nb, plen]
            vis.append(seen[:, None].expand(nb, ql, plen))
        if k_blk is not None:
            ks.append(k_blk[r])
            vs.append(v_blk[r])
            bl = k_blk.shape[2]
            if blk_mask is None:
                vis.append(torch.ones(nb, ql, bl, dtype=torch.bool, device=dev))
            else:
                vis.append(blk_mask[r] if blk_mask.dim() == 4 else blk_mask)
        k = torch.cat(ks, 1).float()  # [nb, L, kvh, d]
        v = torch.cat(vs, 1).float()
        visible = torch.cat(vis, 2)  # [nb, ql, L]
        g = h // k.shape[2]
        k = k.repeat_interleave(g, dim=2)
        v = v.repeat_interleave(g, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q[r].float(), k) * scale
        s = s.masked_fill(~visible[:, None], -math.inf)
        m = s.amax(-1)  # [nb, h, ql]
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe[..., None])
        lsum = p.sum(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", p, v) / lsum.clamp(min=1e-30).transpose(1, 2)[..., None]
        outs.append(o)
        ms.append(m.transpose(1, 2))
        ls.append(lsum.transpose(1, 2))
    return torch.stack(outs).to(q.dtype), torch.stack(ms), torch.stack(ls)


def packed_attention(q, row_request=None, k_cache=None, v_cache=None, block_table=None,
                     prefix_lens=None, k_blk=None, v_blk=None, row_block=None, blk_mask=None,
                     scale=None):
    """Reference of specdec_kernels.packed_attention.packed_attention (same arguments): row i
    attends to its request's whole prefix (row_request[i] >= 0) and to the visible keys of its
    own block (row_block[i] >= 0); dense fp32 softmax per row.
    returns out [rows, heads, dim] fp32 (0 for a row that sees nothing), m, l [rows, heads]."""
    rows, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(rows, h, d, dtype=torch.float32, device=q.device)
    m = torch.full((rows, h), -math.inf, device=q.device)
    lsum = torch.zeros(rows, h, device=q.device)
    for i in range(rows):
        ks, vs = [], []
        if k_cache is not None and int(row_request[i]) >= 0:
            r = int(row_request[i])
            ks.append(paged_prefix(k_cache, block_table[r], int(prefix_lens[r])))
            vs.append(paged_prefix(v_cache, block_table[r], int(prefix_lens[r])))
        if k_blk is not None and int(row_block[i]) >= 0:
            b = int(row_block[i])
            vis = (torch.ones(k_blk.shape[1], dtype=torch.bool, device=q.device)
                   if blk_mask is None else blk_mask[i])
            ks.append(k_blk[b][vis])
            vs.append(v_blk[b][vis])
        if not ks or sum(k.shape[0] for k in ks) == 0:
            continue
        k = torch.cat(ks).float()  # [L, kvh, d]
        v = torch.cat(vs).float()
        g = h // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        m[i] = s.amax(-1)
        p = torch.exp(s - m[i][:, None])
        lsum[i] = p.sum(-1)
        out[i] = torch.einsum("hl,lhd->hd", p, v) / lsum[i][:, None]
    return out, m, lsum


def merge_states(out_a, m_a, l_a, out_b, m_b, l_b):
    """Exact combination of two partial attentions over disjoint key sets.

    out_*,  # [..., heads, dim] normalised outputs
    m_*, l_*,  # [..., heads] fp32 state (natural-log units)
    returns (out, m, l) as if both key sets had been attended at once."""
    m = torch.maximum(m_a, m_b)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa = l_a * torch.exp(m_a - m_safe)
    wb = l_b * torch.exp(m_b - m_safe)
    lsum = wa + wb
    denom = lsum.clamp(min=1e-30)[..., None]
    out = (wa[..., None] * out_a.float() + wb[..., None] * out_b.float()) / denom
    return out.to(out_a.dtype), m, lsum


def merge_pair(out_a, m_a, l_a, out_b, m_b, l_b, rows_a=None, dtype=None):
    """Reference of merge.merge_pair: row r merges a's row rows_a[r] (-1 = empty; all
    rows in order when None) with b's row r.

    out_a,  # [Ra, heads, dim]; m_a, l_a [Ra, heads] fp32
    out_b,  # [R, heads, dim];  m_b, l_b [R, heads] fp32
    rows_a,  # [R] int or None
    returns out [R, heads, dim] (dtype, default out_b.dtype), m, l [R, heads] fp32."""
    if rows_a is not None:
        idx = rows_a.long()
        empty = (idx < 0)[:, None]
        j = idx.clamp(min=0)
        out_a = out_a.float()[j].masked_fill(empty[..., None], 0.0)
        m_a = m_a[j].masked_fill(empty, -math.inf)
        l_a = l_a[j].masked_fill(empty, 0.0)
    out, m, lsum = merge_states(out_a.float(), m_a, l_a, out_b.float(), m_b, l_b)
    return out.to(dtype or out_b.dtype), m, lsum


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference of specdec_kernels.matmul.invariant_linear: x @ w.T in float64, cast to x.dtype.

    x,  # [..., K] float
    w,  # [N, K] float
    returns [..., N] (x.dtype)."""
    return (x.double() @ w.double().T).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference of specdec_kernels.norm.invariant_rms_norm (HF Qwen3RMSNorm).

    x,  # [..., D] float
    weight,  # [D] or [heads, D] (broadcast over x [..., heads, D])
    returns x's shape and dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
