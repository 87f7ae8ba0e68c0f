"""Token trees on the device, with static shapes and no host sync: the build, the ancestor mask
and the greedy walk of the fast runtime's tree rounds (`tree_loop.py`).

Same trees as the reference `tree.build_tree` (the top-`budget` prefixes under the drafter's
marginals; *tree index* 0 is the anchor, node i has tree index i + 1), built as a depth-wise
beam: the top-N prefixes are closed under ancestors (a child scores <= its parent), so the top N
at depth d are children of the top N at depth d - 1, and a global top N over every depth's beam
picks the tree. Node order: by depth, then score (best first): parents precede children.
Ties: equal scores go to the shallower prefix, then to the earlier beam entry (better parent,
then lower rank); the reference breaks ties by heap push order, so the two agree as sets on
tie-free scores. Either rule keeps every parent before its children.
"""

from __future__ import annotations

import math

import torch

from ..errors import require


def beam_widths(depth: int, topk: int, budget: int) -> list[int]:
    """Beam width per depth 1..min(depth, budget): min(budget, topk^d)."""
    widths, w = [], 1
    for _ in range(min(depth, budget)):
        w = min(budget, w * topk)
        widths.append(w)
    return widths


def build_tree(
    top_lp: torch.Tensor,  # [batch, g, k] log-probs at depths 1..g, best first (`draft_topk`)
    top_ids: torch.Tensor,  # [batch, g, k] their token ids
    budget: int,  # nodes per row: at most `tree.capacity(g, k)`
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens, parents, depths [batch, budget]
    """Every row's tree of exactly `budget` nodes: tokens, parents (tree indices, 0 = anchor)
    and depths (1..g)."""
    b, g, k = top_lp.shape
    widths = beam_widths(g, k, budget)
    require(budget <= sum(widths), "tree_budget",
            f"must be <= {sum(widths)} (the capacity of {g} levels of top-{k}), got {budget}")
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


def _jumps(depth: int) -> int:
    """Pointer-doubling steps that reach every ancestor of a tree `depth` levels deep."""
    return max(1, math.ceil(math.log2(depth + 1)))


def ancestor_mask(
    parents: torch.Tensor,  # [batch, n + 1] long, tree index of each index's parent (root: 0)
    depth: int,  # the trees' maximum depth
) -> torch.Tensor:  # [batch, n + 1, n + 1] bool: ancestor-or-self (`tree.tree_mask`)
    """By pointer doubling: after j steps each index sees itself and its 2^j - 1 nearest
    ancestors."""
    b, m = parents.shape
    up = parents  # after j steps: the ancestor 2^j levels up (the root stays at the root)
    seen = torch.eye(m, dtype=torch.bool, device=parents.device).expand(b, m, m)
    for _ in range(_jumps(depth)):
        seen = seen | seen.gather(1, up[:, :, None].expand(b, m, m))
        up = up.gather(1, up)
    return seen


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
    for _ in range(_jumps(depth)):
        good = good & good.gather(1, up)
        up = up.gather(1, up)
    at = torch.where(good, depths, depth + 1)  # the dump column past the deepest depth
    path = torch.zeros(b, depth + 2, dtype=torch.long, device=tokens.device)
    path.scatter_(1, at, torch.arange(m, device=tokens.device).expand(b, m))
    return path[:, :depth + 1], good[:, 1:].sum(-1)
