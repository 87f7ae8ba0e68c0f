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


def beam_widths(depth: int, topk: int, budget: int) -> list[int]:
    """Beam width per depth 1..min(depth, budget): min(budget, topk^d)."""
    widths, w = [], 1
    for _ in range(min(depth, budget)):
        w = min(budget, w * topk)
        widths.append(w)
    return widths


def tree_build(
    top_lp: torch.Tensor,  # [batch, g, k] log-probs at depths 1..g, best first (`draft_topk`)
    top_ids: torch.Tensor,  # [batch, g, k] their token ids
    budget: int,  # nodes per row: at most `tree.capacity(g, k)`
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens, parents, depths [batch, budget]
    """Reference of specdec_kernels.tree_build.tree_build: every row's tree of exactly `budget`
    nodes (the top-`budget` prefixes under the drafter's marginals) as a depth-wise beam; the top
    N prefixes are closed under ancestors, so the top N at depth d are children of the top N at
    depth d - 1, and a global top N over every depth's beam picks the tree. Node order: by
    depth, then score (best first): parents precede children (tree index = order + 1; 0 is the
    anchor). Ties: equal scores go to the shallower prefix, then to the earlier beam entry.
    Returns tokens, parents (tree indices, 0 = anchor) and depths (1..g) [batch, budget]."""
    b, g, k = top_lp.shape
    widths = beam_widths(g, k, budget)
    scores, parents, tokens, depths = [], [], [], []
    beam = top_lp.new_zeros(b, 1)  # [batch, width] scores of the previous depth's beam
    offset = 0  # candidate index of the previous beam's first entry (-1: the root)
    for d, w in enumerate(widths):
        child = (beam[:, :, None] + top_lp[:, d, None, :]).reshape(b, -1)  # [batch, w_prev * k]
        beam, idx = child.sort(dim=-1, descending=True, stable=True)
        beam, idx = beam[:, :w], idx[:, :w]
        scores.append(beam)
        tokens.append(top_ids[:, d].gather(1, idx % k))
        parents.append(idx // k + offset if d else torch.full_like(idx, -1))
        depths.append(torch.full_like(idx, d + 1))
        offset = sum(widths[:d])
    score, parent_c = torch.cat(scores, 1), torch.cat(parents, 1)  # [batch, C] candidates
    # candidates lie in (depth, score) order, so a stable sort keeps shallower ties first
    chosen = score.sort(dim=-1, descending=True, stable=True)[1][:, :budget].sort(-1)[0]
    index = torch.zeros_like(score, dtype=torch.long)  # candidate -> tree index (0: not kept)
    index.scatter_(1, chosen, torch.arange(1, budget + 1, device=score.device).expand(b, -1))
    par = parent_c.gather(1, chosen)
    tree_parents = torch.where(par >= 0, index.gather(1, par.clamp_min(0)), 0)
    return (torch.cat(tokens, 1).gather(1, chosen), tree_parents,
            torch.cat(depths, 1).gather(1, chosen))


def doubling_steps(depth: int) -> int:
    """Pointer-doubling steps that reach every ancestor of a tree `depth` levels deep."""
    return max(1, math.ceil(math.log2(depth + 1)))


def greedy_path(
    tokens: torch.Tensor,  # [batch, n + 1] anchor, then the nodes' draft tokens
    parents: torch.Tensor,  # [batch, n + 1] long (root: 0)
    depths: torch.Tensor,  # [batch, n + 1] long (root: 0)
    choice: torch.Tensor,  # [batch, n + 1] the target's argmax at every tree index
    depth: int,  # the trees' maximum depth D
) -> tuple[torch.Tensor, torch.Tensor]:  # path [batch, D + 1] tree indices, accepted [batch]
    """The walk of `tree.walk_tree`, vectorised: a node is *ok* when its token is the target's
    choice at its parent, and on the path when it and all its ancestors are ok (siblings carry
    distinct tokens, so those nodes form one path from the root). path[:, j] is the path's node
    at depth j for j <= accepted (path[:, 0] = 0, the anchor) and 0 past it."""
    b, m = tokens.shape
    good = tokens == choice.gather(1, parents)
    good[:, 0] = True
    up = parents
    for _ in range(doubling_steps(depth)):
        good = good & good.gather(1, up)
        up = up.gather(1, up)
    at = torch.where(good, depths, depth + 1)  # the dump column past the deepest depth
    path = torch.zeros(b, depth + 2, dtype=torch.long, device=tokens.device)
    path.scatter_(1, at, torch.arange(m, device=tokens.device).expand(b, m))
    return path[:, :depth + 1], good[:, 1:].sum(-1)


def tree_accept(
    choice: torch.Tensor,  # [b, W] long: the target's argmax at every tree index
    draft: torch.Tensor,  # [b, W] long: root (anchor), then the nodes' draft tokens
    parents: torch.Tensor,  # [b, W] long: tree index of each parent (root: 0)
    depths: torch.Tensor,  # [b, W] long (root: 0)
    loc: torch.Tensor,  # [b, W] long: the verify's KV slot of every tree index
    live: torch.Tensor,  # [b] bool: False for padded rows
    depth: int,  # D: the trees' maximum depth (D + 1 <= W)
):
    """Reference of specdec_kernels.tree_accept.tree_accept: the greedy acceptance of a tree
    round per row (`greedy_path`) and what follows from it. Returns
    predict [b, W] int32: the target's token after each path node in path order, then 0;
    path [b, D + 1] long: the path's tree index at each depth, 0 past it;
    n [b] int32: the path's length, root included (accepted drafts + 1; 0 for a dead row);
    bonus [b] long: the token after the last path node (0 for a dead row);
    tgt, src [b, D + 1] long: the KV move of the path onto the front slots (the slot of the
    path's node at depth d onto the slot of tree index d); slot 0 onto itself past the path."""
    path, accepted = greedy_path(draft, parents, depths, choice, depth)
    d1 = depth + 1
    on = (torch.arange(d1, device=choice.device) <= accepted[:, None]) & live[:, None]
    path = torch.where(on, path, 0)
    tok = torch.where(on, choice.gather(1, path), 0)
    n = on.sum(-1)
    predict = torch.zeros(choice.shape, dtype=torch.int32, device=choice.device)
    predict[:, :d1] = tok.to(torch.int32)
    bonus = tok.gather(1, (n - 1).clamp_min(0)[:, None])[:, 0]
    tgt = torch.where(on, loc[:, :d1], 0)
    src = torch.where(on, loc.gather(1, path), 0)
    return predict, path, n.to(torch.int32), bonus, tgt, src
