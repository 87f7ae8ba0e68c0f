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
    child_table,
    doubling_steps,
    greedy_path,
)

from ..errors import require
from ..sampling import SamplingParams, sampling_probs


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
    """`tree.rejection_walk` for every row at once: `specdec_kernels.reference.tree_rejection`
    (D x topk static steps) on the target's transformed probabilities, its uniforms drawn from
    `generator`. path is laid out as `greedy_path`'s."""
    b, dev = tokens.shape[0], tokens.device
    u = torch.rand(b, depth, topk, generator=generator, device=dev)
    u_bonus = torch.rand(b, generator=generator, device=dev)
    return reference.tree_rejection(sampling_probs(logits, params), q[:, :depth], tokens,
                                    parents, u, u_bonus)
