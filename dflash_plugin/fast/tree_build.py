"""Token trees on the device, with static shapes and no host sync, for the fast runtime's tree
rounds (`tree_loop.py`): the build (`build_tree`: torch or the Triton kernel), the ancestor mask
and the greedy walk (torch, in `specdec_kernels.tree_reference`, re-exported here), and the
sampled walk (recursive rejection sampling, `tree.rejection_walk`).

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

import torch
from specdec_kernels import reference
from specdec_kernels.reference import (  # noqa: F401 (the fast runtime imports them here)
    ancestor_mask,
    beam_widths,
    doubling_steps,
    greedy_path,
)

from ..errors import require
from ..sampling import SamplingParams, sampling_probs
from ..tree import sample_ranks


def build_tree(
    top_lp: torch.Tensor,  # [batch, g, k] log-probs at depths 1..g, best first (`draft_topk`)
    top_ids: torch.Tensor,  # [batch, g, k] their token ids
    budget: int,  # nodes per row: at most `tree.capacity(g, k)`
    triton: bool = False,  # the fused Triton kernel (`specdec_kernels.tree_build`; CUDA)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens, parents, depths [batch, budget]
    """Every row's tree of exactly `budget` nodes: tokens, parents (tree indices, 0 = anchor)
    and depths (1..g). The torch version is `specdec_kernels.reference.tree_build`; `triton`
    runs the same build as one kernel (one program per row) instead of about 8 launches per
    depth."""
    b, g, k = top_lp.shape
    widths = beam_widths(g, k, budget)
    require(budget <= sum(widths), "tree_budget",
            f"must be <= {sum(widths)} (the capacity of {g} levels of top-{k}), got {budget}")
    if triton:
        from specdec_kernels.tree_build import tree_build

        return tree_build(top_lp, top_ids, budget)
    return reference.tree_build(top_lp, top_ids, budget)


def child_table(
    parents: torch.Tensor,  # [batch, m] long, tree index of each index's parent (root: 0)
    topk: int,  # children per node at most
) -> torch.Tensor:  # [batch, m, topk] long: tree index of each node's r-th child, 0 = none
    """A node's children in tree-index order, which is their rank order (`build_tree` orders
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


def rejection_path(
    tokens: torch.Tensor,  # [batch, m] anchor, then the nodes' draft tokens (m = n + 1)
    parents: torch.Tensor,  # [batch, m] long (root: 0)
    logits: torch.Tensor,  # [batch, m, vocab] the target's logits at every tree index
    q: torch.Tensor,  # [batch, D, vocab] the drafter's probabilities at depths 1..D
    params: SamplingParams,  # the transform of the target's logits (q has it applied)
    depth: int,  # the trees' maximum depth D
    topk: int,  # children per node at most
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # path [batch, D + 1], accepted, bonus
    """`tree.rejection_walk` for every row at once, in D x topk static steps: at each depth the
    current node's children are tried in rank order against the residual r (a kept child moves
    the row down and resets r to the target's p there; a rejection updates r and the proposal
    s); rows that stopped keep their residual, and the bonus is a sample from it. path is laid
    out as `greedy_path`'s."""
    b, m = tokens.shape
    dev = tokens.device
    kid = child_table(parents, topk)
    rows = torch.arange(b, device=dev)
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    accepted = torch.zeros(b, dtype=torch.long, device=dev)
    path = torch.zeros(b, depth + 1, dtype=torch.long, device=dev)
    r = sampling_probs(logits[:, 0], params)  # [batch, vocab]
    for j in range(depth):
        s = q[:, j].float()
        nxt = cur.clone()
        moved = torch.zeros_like(alive)
        for i in range(topk):
            c = kid[rows, cur, i]  # [batch] 0 = no such child
            x = tokens.gather(1, c[:, None])
            sx, rx = s.gather(1, x)[:, 0], r.gather(1, x)[:, 0]
            tried = alive & ~moved & (c > 0) & (sx > 0)
            u = torch.rand(b, generator=generator, device=dev)
            keep = tried & (u * sx < rx)
            miss = (tried & ~keep)[:, None]
            residual = (r - s).clamp_min(0)
            mass = residual.sum(-1, keepdim=True)
            r = torch.where(miss & (mass > 0), residual / mass.clamp_min(1e-30), r)
            s_out = s.scatter(1, x, 0.0)
            s = torch.where(miss, s_out / s_out.sum(-1, keepdim=True).clamp_min(1e-30), s)
            nxt = torch.where(keep, c, nxt)
            moved = moved | keep
        cur = nxt
        path[:, j + 1] = torch.where(moved, cur, 0)
        accepted = accepted + moved.long()
        alive = alive & moved
        here = logits.gather(1, cur[:, None, None].expand(b, 1, logits.shape[-1]))[:, 0]
        r = torch.where(moved[:, None], sampling_probs(here, params), r)
    return path, accepted, sample_ranks(r, 1, generator)[:, 0]  # a sample of r (Gumbel-max)
