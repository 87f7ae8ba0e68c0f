"""Tree drafting (DDTree-style): the most probable draft prefixes, verified in ONE target forward.

A DFlash forward gives a distribution at every block position d = 1..g (each conditioned on the
anchor only). A *tree* keeps the `budget` most probable prefixes under those marginals: a node
is a rank tuple (r_1, ..., r_d) naming the r-th most likely token at each depth, scored by its
summed log-probability. *Tree index* 0 is the anchor (the root, depth 0); node i has tree index
i + 1, and every node comes after its parent. Greedy verification walks from the root along the
child whose token is the target's argmax at the current node. Sampled verification (T > 0) is
*recursive rejection sampling* over each node's children (`rejection_walk`): the children are
drafted as a sample without replacement from the drafter's q (`sample_ranks`), tried in order
against the target's residual distribution; the output is distributed as the target's.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from specdec_kernels.sampling import gumbel_keys

from .errors import require
from .sampling import SamplingParams, sampling_probs


@dataclass(frozen=True)
class Tree:
    tokens: list[int]  # [nodes] draft token of each node
    parents: list[int]  # [nodes] tree index of each node's parent (0 = the anchor)
    depths: list[int]  # [nodes] 1..g

    def __len__(self) -> int:
        return len(self.tokens)


def capacity(depth: int, topk: int) -> int:
    """Nodes of the full top-k tree of `depth` levels: k + k^2 + ... + k^depth."""
    return sum(topk ** d for d in range(1, depth + 1))


def build_tree(
    logprobs: torch.Tensor,  # [g, vocab] the drafter's log-probabilities at depths 1..g
    budget: int,  # nodes to keep (at most capacity(g, topk))
    topk: int,  # candidates per depth
    ranked: torch.Tensor | None = None,  # [g, topk] token of each (depth, rank); None: the top-k
) -> Tree:
    """Best-first search over rank tuples: each pop adds the best open prefix as a node and opens
    its next sibling (rank + 1 at its depth) and its first child (rank 0 one depth further). Each
    prefix scores at most as much as its parent, so the nodes are the top-`budget` prefixes and
    every parent precedes its children; a node's children come in rank order. The shape depends
    on the sorted log-probabilities only; `ranked` (sampled drafts) fills in the tokens."""
    g, vocab = logprobs.shape
    require(budget >= 1, "tree_budget", f"must be >= 1, got {budget}")
    require(1 <= topk <= vocab, "tree_topk", f"must be in [1, {vocab}], got {topk}")
    top_lp, top_ids = logprobs.float().topk(topk, dim=-1)  # [g, topk]
    lp, ids = top_lp.tolist(), (top_ids if ranked is None else ranked).tolist()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    # (-score, tie-break, depth, rank, parent tree index)
    heap = [(-lp[0][0], 0, 1, 0, 0)]
    pushed = 1
    while heap and len(tokens) < budget:
        neg, _, d, r, parent = heapq.heappop(heap)
        tokens.append(ids[d - 1][r])
        parents.append(parent)
        depths.append(d)
        me = len(tokens)  # this node's tree index
        if r + 1 < topk:  # next sibling: same parent, next rank at this depth
            heapq.heappush(heap, (neg + lp[d - 1][r] - lp[d - 1][r + 1], pushed, d, r + 1, parent))
            pushed += 1
        if d < g:  # first child: rank 0 one depth further
            heapq.heappush(heap, (neg - lp[d][0], pushed, d + 1, 0, me))
            pushed += 1
    return Tree(tokens, parents, depths)


def tree_mask(trees: list[Tree], device=None) -> torch.Tensor:  # [batch, n + 1, n + 1] bool
    """Ancestor-or-self visibility over [anchor, nodes...] per row (all trees of one size)."""
    n = len(trees[0])
    require(all(len(t) == n for t in trees), "trees", "every row's tree must have as many nodes")
    mask = torch.zeros(len(trees), n + 1, n + 1, dtype=torch.bool)
    mask[:, :, 0] = True
    for b, t in enumerate(trees):
        for i, p in enumerate(t.parents):
            mask[b, i + 1] = mask[b, p]
            mask[b, i + 1, i + 1] = True
    return mask.to(device) if device is not None else mask


def walk_tree(
    tree: Tree,
    choice: list[int],  # [n + 1] the target's token at each tree index (argmax or a sample)
) -> tuple[list[int], int]:  # accepted nodes (tree indices, root excluded) in path order, bonus
    """From the root, move to the child whose token is the target's choice at the current
    node; stop where no child has it. The bonus is the target's choice at the last node."""
    children: dict[tuple[int, int], int] = {}
    for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault((p, tok), i + 1)  # siblings carry distinct tokens (top-k ranks)
    path, node = [], 0
    while (nxt := children.get((node, choice[node]))) is not None:
        path.append(nxt)
        node = nxt
    return path, choice[node]


def sample_ranks(
    q: torch.Tensor,  # [..., g, vocab] the drafter's (transformed) probabilities per depth
    topk: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [..., g, topk] long
    """A sample without replacement of `topk` tokens per depth, in draw order (Gumbel top-k:
    the order of `gumbel_keys(log q)`). Past q's support the ranks hold zero-probability
    tokens, which `rejection_walk` never accepts."""
    return gumbel_keys(q.float().log(), generator).topk(topk, dim=-1).indices


def sampled_drafts(
    logits: torch.Tensor,  # [..., g, vocab] the drafter's logits per depth
    params: SamplingParams,  # T > 0: the transform the target's logits get too
    topk: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q, shape log-probs, ranked tokens
    """A sampled tree's inputs: q (the drafter's transformed probabilities, the walk's
    proposal), the log-probabilities the shape is built from (q's, zeros floored: ranks past q's
    support stay finite and come last) and the token of every (depth, rank): `sample_ranks`."""
    q = sampling_probs(logits, params)
    return q, q.clamp_min(1e-30).log(), sample_ranks(q, topk, generator)


def rejection_walk(
    tree: Tree,
    p: torch.Tensor,  # [n + 1, vocab] the target's (transformed) probabilities at each tree index
    q: torch.Tensor,  # [g, vocab] the drafter's probabilities per depth, the children's proposal
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:  # accepted nodes (tree indices, root excluded) in path order, bonus
    """Recursive rejection sampling down the tree. At a node with target distribution r = p and
    proposal s = q of the next depth, try the children in rank order (a sample without
    replacement from s): keep child x with probability min(1, r(x) / s(x)) and move there; else
    r <- normalize(max(r - s, 0)) and s <- s without x, renormalized. When no child is kept
    (or there are none), the bonus is a sample from r. Each step outputs r exactly (the
    rejection-sampling identity, applied per sibling), so the path and bonus follow the target.
    The children's number comes from the shape (q's sorted values), never from the draws."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(i + 1)  # rank order (build_tree pops it so)
    path, node = [], 0
    while True:
        r = p[node].double()
        kids = children.get(node, [])
        s = q[tree.depths[kids[0] - 1] - 1].double() if kids else None
        moved = False
        for c in kids:
            x = tree.tokens[c - 1]
            if s[x] <= 0:  # past the proposal's support: no later sibling is drawn either
                break
            u = torch.rand((), generator=generator, device=p.device, dtype=torch.float64)
            if u * s[x] < r[x]:
                path.append(c)
                node, moved = c, True
                break
            residual = (r - s).clamp_min(0)
            mass = residual.sum()
            r = residual / mass if mass > 0 else r  # mass 0: a rejection had probability 0
            s = s.clone()
            s[x] = 0
            s = s / s.sum() if s.sum() > 0 else s
        if not moved:
            return path, int(torch.multinomial(r.float(), 1, generator=generator))
