"""Pure-torch references (the spec) of the token-tree kernels (`tree_build`, `tree_accept`,
`tree_rejection`) and of their parts; re-exported by `reference`. Terms: *tree index* 0 is the
anchor (the root: the last committed token), node i of a tree of N nodes has tree index i + 1,
and every parent has a smaller tree index than its children; W = N + 1; D = the trees' maximum
depth."""

from __future__ import annotations

import math

import torch


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
    choice: torch.Tensor,  # [b, W] long: the target's token at every tree index (argmax or sample)
    draft: torch.Tensor,  # [b, W] long: root (anchor), then the nodes' draft tokens
    parents: torch.Tensor,  # [b, W] long: tree index of each parent (root: 0)
    depths: torch.Tensor,  # [b, W] long (root: 0)
    loc: torch.Tensor,  # [b, W] long: the verify's KV slot of every tree index
    live: torch.Tensor,  # [b] bool: False for padded rows
    depth: int,  # D: the trees' maximum depth (D + 1 <= W)
):
    """Reference of specdec_kernels.tree_accept.tree_accept: the greedy acceptance of a tree
    round per row (`greedy_path`) and what follows from it (`path_outputs`)."""
    path, accepted = greedy_path(draft, parents, depths, choice, depth)
    return path_outputs(choice.gather(1, path), path, accepted, loc, live)


def path_outputs(
    tok: torch.Tensor,  # [b, D + 1] long: the target's token after each path node (then any)
    path: torch.Tensor,  # [b, D + 1] long: the path's tree index at each depth (then any)
    accepted: torch.Tensor,  # [b] accepted drafts (the path's length without the root)
    loc: torch.Tensor,  # [b, W] long: the verify's KV slot of every tree index
    live: torch.Tensor,  # [b] bool: False for padded rows
):
    """What a round commits, given its path. Returns
    predict [b, W] int32: the target's token after each path node in path order, then 0;
    path [b, D + 1] long: the path's tree index at each depth, 0 past it;
    n [b] int32: the path's length, root included (accepted drafts + 1; 0 for a dead row);
    bonus [b] long: the token after the last path node (0 for a dead row);
    tgt, src [b, D + 1] long: the KV move of the path onto the front slots (the slot of the
    path's node at depth d onto the slot of tree index d); slot 0 onto itself past the path."""
    d1 = path.shape[1]
    on = (torch.arange(d1, device=path.device) <= accepted[:, None]) & live[:, None]
    path = torch.where(on, path, 0)
    tok = torch.where(on, tok, 0)
    n = on.sum(-1)
    predict = torch.zeros(loc.shape, dtype=torch.int32, device=loc.device)
    predict[:, :d1] = tok.to(torch.int32)
    bonus = tok.gather(1, (n - 1).clamp_min(0)[:, None])[:, 0]
    tgt = torch.where(on, loc[:, :d1], 0)
    src = torch.where(on, loc.gather(1, path), 0)
    return predict, path, n.to(torch.int32), bonus, tgt, src


def child_table(
    parents: torch.Tensor,  # [batch, m] long, tree index of each index's parent (root: 0)
    topk: int,  # children per node at most
) -> torch.Tensor:  # [batch, m, topk] long: tree index of each node's r-th child, 0 = none
    """A node's children in tree-index order, which is their rank order (`tree_build` orders
    siblings by score, best first)."""
    b, m = parents.shape
    idx = torch.arange(m, device=parents.device)
    sib = (parents[:, :, None] == parents[:, None, :]) & (idx[None, None] < idx[None, :, None])
    rank = sib[:, :, 1:].sum(-1)  # [batch, m] earlier siblings (the root, index 0, is none)
    row = torch.where(idx >= 1, parents, 0)
    col = torch.where(idx >= 1, rank, topk)  # the root goes to a dump column
    kid = torch.zeros(b, m * (topk + 1), dtype=torch.long, device=parents.device)
    kid.scatter_(1, row * (topk + 1) + col, idx.expand(b, m))
    return kid.view(b, m, topk + 1)[:, :, :topk]


def tree_rejection(
    p: torch.Tensor,  # [b, W, V] the target's (transformed) probabilities at every tree index
    q: torch.Tensor,  # [b, D, V] the drafter's probabilities at depths 1..D (the proposal)
    draft: torch.Tensor,  # [b, W] long: root, then the nodes' draft tokens
    parents: torch.Tensor,  # [b, W] long (root: 0)
    u: torch.Tensor,  # [b, D, K] uniforms in [0, 1): the trial of rank i's child at depth j + 1
    u_bonus: torch.Tensor,  # [b] a uniform in [0, 1): the bonus
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # path [b, D + 1], accepted [b], bonus [b]
    """Reference of specdec_kernels.tree_rejection.tree_rejection: recursive rejection sampling
    down every row's tree (`dflash_plugin.tree.rejection_walk`), in D x K static steps. At a
    node r is the target's p there and s the proposal of the next depth; its children are tried
    in rank order (tree-index order): child x is kept when u * s(x) < r(x), and the row moves
    to it (r resets to p there); a rejection sets r to normalize(max(r - s, 0)) (left as it was
    if that is 0 everywhere, an event of probability 0) and takes x out of s (renormalised); a
    child with s(x) = 0 ends the node (the siblings were drawn from s without replacement, so
    none after it is in s's support). Where no child is kept, the bonus is the first token whose
    cumulative r (fp64) exceeds u_bonus times r's total (the last token with r > 0 if rounding
    leaves none). Every emitted token then follows the target's distribution given the tokens
    before it. path[:, j] is the path's tree index at depth j (0 past it), as `greedy_path`'s."""
    b, w, v = p.shape
    depth, k = u.shape[1], u.shape[2]
    kid = child_table(parents, k)
    rows = torch.arange(b, device=p.device)
    cur = torch.zeros(b, dtype=torch.long, device=p.device)
    alive = torch.ones(b, dtype=torch.bool, device=p.device)
    accepted = torch.zeros(b, dtype=torch.long, device=p.device)
    path = torch.zeros(b, depth + 1, dtype=torch.long, device=p.device)
    r = p[:, 0].float()  # [b, V]
    for j in range(depth):
        s = q[:, j].float()
        moved = torch.zeros_like(alive)
        stop = torch.zeros_like(alive)
        for i in range(k):
            c = kid[rows, cur, i]  # [b] 0 = no such child
            x = draft.gather(1, c[:, None])
            sx, rx = s.gather(1, x)[:, 0], r.gather(1, x)[:, 0]
            ready = alive & ~moved & ~stop & (c > 0)
            stop = stop | (ready & (sx <= 0))
            tried = ready & (sx > 0)
            keep = tried & (u[:, j, i] * sx < rx)
            miss = (tried & ~keep)[:, None]
            residual = (r - s).clamp_min(0)
            mass = residual.sum(-1, keepdim=True)
            r = torch.where(miss & (mass > 0), residual / mass.clamp_min(1e-30), r)
            s_out = s.scatter(1, x, 0.0)
            s = torch.where(miss, s_out / s_out.sum(-1, keepdim=True).clamp_min(1e-30), s)
            cur = torch.where(keep, c, cur)
            moved = moved | keep
        path[:, j + 1] = torch.where(moved, cur, 0)
        accepted = accepted + moved.long()
        alive = alive & moved
        r = torch.where(moved[:, None], p[rows, cur].float(), r)
    cdf = r.double().cumsum(-1)
    hit = cdf > u_bonus.double()[:, None] * cdf[:, -1:]
    last = torch.where(r > 0, torch.arange(v, device=p.device), 0).max(-1).values
    bonus = torch.where(hit.any(-1), hit.int().argmax(-1), last)
    return path, accepted, bonus


def ancestor_mask(
    parents: torch.Tensor,  # [batch, n + 1] long, tree index of each index's parent (root: 0)
    depth: int,  # the trees' maximum depth
) -> torch.Tensor:  # [batch, n + 1, n + 1] bool: ancestor-or-self (`tree.tree_mask`)
    """By pointer doubling: after j steps each index sees itself and its 2^j - 1 nearest
    ancestors."""
    b, m = parents.shape
    up = parents  # after j steps: the ancestor 2^j levels up (the root stays at the root)
    seen = torch.eye(m, dtype=torch.bool, device=parents.device).expand(b, m, m)
    for _ in range(doubling_steps(depth)):
        seen = seen | seen.gather(1, up[:, :, None].expand(b, m, m))
        up = up.gather(1, up)
    return seen


def full_parents(parents: torch.Tensor) -> torch.Tensor:  # [bs, W] long, root's parent: 0
    """Prepend the root (its own parent) to the nodes' parents `[bs, N]` (tree indices)."""
    return torch.cat([parents.new_zeros(parents.shape[0], 1), parents], 1).long()


def tree_links(
    parents: torch.Tensor,  # [bs, W] long, from `full_parents`
) -> tuple[torch.Tensor, torch.Tensor]:  # next_token, next_sibling [bs, W] long (-1: none)
    """First child (smallest tree index) and next sibling (next larger index, same parent)."""
    bs, w = parents.shape
    idx = torch.arange(w, device=parents.device)
    node = idx > 0  # the root is nobody's child
    child = (parents[:, None, :] == idx[None, :, None]) & node  # [bs, i, j]: j is a child of i
    first = torch.where(child, idx, w).min(-1).values
    same = (parents[:, :, None] == parents[:, None, :]) & (idx[None, :] > idx[:, None])
    same = same & node[None, :, None] & node[None, None, :]  # [bs, j, k]: k after sibling j
    sib = torch.where(same, idx, w).min(-1).values
    none = torch.full_like(first, -1)
    return torch.where(first < w, first, none), torch.where(sib < w, sib, none)


def mask_positions(
    seq_lens: torch.Tensor,  # [bs] committed prefix lengths (device)
    w: int,  # W: tree tokens per request
) -> torch.Tensor:  # [bs, W, W] long: flat FULL_MASK position of anc[b, i, j]
    """Where each tree entry of the FULL mask lies: per request W rows of seq_len + W columns,
    requests concatenated, the tree's W columns last in each row. Device only, static shape:
    the tree phase's graph computes it (`tree_parts`)."""
    bs = seq_lens.shape[0]
    lens = seq_lens.long()
    start = w * (torch.cumsum(lens, 0) - lens) + torch.arange(bs, device=lens.device) * w * w
    i = torch.arange(w, device=lens.device)
    return (start[:, None, None] + i[None, :, None] * (lens + w)[:, None, None]
            + lens[:, None, None] + i[None, None, :])


def tree_tensors(
    tokens: torch.Tensor,  # [b, N] draft tokens in tree order (parent before child)
    parents: torch.Tensor,  # [b, N] tree index of each node's parent (0 = root)
    depths: torch.Tensor,  # [b, N] 1..D
    root: torch.Tensor,  # [b] the root's token (the last round's bonus)
    seq_lens: torch.Tensor,  # [b] committed prefix lengths (the root's position)
    depth: int,  # D: static bound on depths
):
    """Reference of specdec_kernels.tree_build.tree_tensors: what a tree verify reads of every
    row's tree, all [b, W] long unless noted: draft (root first), positions (seq_len + depth),
    parents and depths (root first: 0), retrieve index (b * W + i), first child and next
    sibling (-1: none), the ancestor-or-self mask [b, W, W] bool and the FULL mask's tree
    positions [b, W, W] (`mask_positions`)."""
    b, n = tokens.shape
    w = n + 1
    par = full_parents(parents)
    dep = torch.cat([depths.new_zeros(b, 1), depths], 1).long()
    nxt, sib = tree_links(par)
    draft = torch.cat([root.reshape(b, 1).to(tokens.dtype), tokens], 1).long()
    index = (torch.arange(b, device=tokens.device)[:, None] * w
             + torch.arange(w, device=tokens.device)[None, :])
    return (draft, seq_lens.long()[:, None] + dep, par, dep, index, nxt, sib,
            ancestor_mask(par, max(1, depth)), mask_positions(seq_lens, w))
