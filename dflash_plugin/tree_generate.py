"""Reference tree-drafting loop: prefill, then rounds of draft -> build tree -> verify -> walk.

Each round runs the drafter once over [anchor, g masks] (g <= B - 1), builds a tree of at most
`budget` nodes per row from its per-position distributions (`tree.build_tree`), and verifies
[anchor + nodes] in ONE target forward under the ancestor mask, positions = anchor + depth. The
accepted path plus the bonus is committed; the caches of target and drafter keep the anchor and
the path's slots (in path order: a node's tree index exceeds its parent's) and drop the rest.
Greedy output equals plain greedy decoding. Sampled (T > 0): the tree's shape comes from the
drafter's transformed q, its tokens are a sample without replacement from q per depth, and the
walk is recursive rejection sampling (`tree.rejection_walk`): the output follows the target's
distribution.
"""

from __future__ import annotations

import time

import torch

from .errors import require
from .generate import _commit_tokens, _sync, start_loop, validate_request
from .metrics import GenerationResult
from .sampling import SamplingParams, sampling_probs
from .tree import build_tree, capacity, rejection_walk, sampled_drafts, tree_mask, walk_tree


@torch.inference_mode()
def tree_generate(
    target: torch.nn.Module,  # Hugging Face causal LM
    proposer,  # has `draft_logits(anchor_ids, anchor_pos, g) -> [batch, g, vocab]`
    prompts: list[list[int]],
    *,
    tree_budget: int,
    tree_topk: int = 4,
    block_size: int = 16,
    max_new_tokens: int = 128,
    params: SamplingParams = SamplingParams(),
    stop_token_ids: tuple[int, ...] = (),
) -> GenerationResult:
    cfg = target.config
    validate_request(prompts, max_new_tokens, block_size, cfg.vocab_size,
                     cfg.max_position_embeddings)
    require(tree_budget >= 1, "tree_budget", f"must be >= 1 (0 = linear drafting), got "
            f"{tree_budget}")
    require(1 <= tree_topk <= cfg.vocab_size, "tree_topk",
            f"must be in [1, {cfg.vocab_size}], got {tree_topk}")
    require(hasattr(proposer, "draft_logits"), "proposer",
            "tree drafting needs per-position draft distributions (the DFlash drafter)")
    device = target.get_input_embeddings().weight.device
    lp = start_loop(target, proposer, prompts, params, stop_token_ids)
    runner, gen, stops, agg, out, t_start = lp.runner, lp.gen, lp.stops, lp.agg, lp.out, lp.t_start
    agg.tree = {"nodes_verified": 0, "build_seconds": 0.0, "accepted_depths": {}}  # metrics.py
    while True:
        if not lp.drop_finished(max_new_tokens):
            break
        rows, anchor, anchor_pos = lp.rows, lp.anchor, lp.anchor_pos
        remaining = [max_new_tokens - len(out[r]) for r in rows]
        g = min(block_size - 1, max(remaining))  # the linear loop's rule (generate.py)
        n = min(tree_budget, capacity(g, tree_topk))

        t0 = time.perf_counter()
        logits = proposer.draft_logits(anchor, anchor_pos, g).float()  # [batch, g, vocab]
        tb = time.perf_counter()
        if params.greedy:
            trees = [build_tree(lp, n, tree_topk) for lp in logits.log_softmax(-1).cpu()]
        else:  # shape from q, tokens drawn from q
            q, shape_lp, ranked = sampled_drafts(logits, params, tree_topk, gen)
            shape_lp, ranked = shape_lp.cpu(), ranked.cpu()
            trees = [build_tree(shape_lp[i], n, tree_topk, ranked[i]) for i in range(len(q))]
        agg.tree["build_seconds"] += time.perf_counter() - tb
        _sync(device)
        t1 = time.perf_counter()
        block = torch.tensor([[0] + t.tokens for t in trees], device=device)  # [batch, n + 1]
        block[:, 0] = anchor
        depth = torch.tensor([[0] + t.depths for t in trees], device=device)
        positions = anchor_pos[:, None] + depth
        logits, feats = runner.verify_tree(block, positions, tree_mask(trees, device))
        if params.greedy:
            choice = logits.argmax(-1).tolist()  # [batch, n + 1]
        else:
            p = sampling_probs(logits, params)  # [batch, n + 1, vocab]
        paths, new_tokens, accepted = [], [], []
        for i, t in enumerate(trees):
            if params.greedy:
                path, bonus = walk_tree(t, choice[i])
            else:
                path, bonus = rejection_walk(t, p[i], q[i], gen)
            paths.append(path)
            new_tokens.append([t.tokens[j - 1] for j in path] + [bonus])
            accepted.append(len(path))
            agg.tree["accepted_depths"][len(path)] = agg.tree["accepted_depths"].get(
                len(path), 0) + 1
        agg.tree["nodes_verified"] += n * len(trees)
        produced = _commit_tokens(new_tokens, accepted, remaining, stops, out, rows, agg, g)
        keep_slots = torch.zeros(len(trees), n + 1, dtype=torch.bool)
        keep_slots[:, 0] = True  # the anchor
        for i, path in enumerate(paths):
            keep_slots[i, path[: produced[i] - 1]] = True  # the committed path, bonus excluded
        keep_slots = keep_slots.to(device)
        runner.commit(keep_slots)
        proposer.observe(block, feats, positions, keep_slots)
        lp.anchor = torch.tensor([toks[p - 1] for toks, p in zip(new_tokens, produced)],
                                 device=device)
        lp.anchor_pos = anchor_pos + torch.tensor(produced, device=device)
        _sync(device)
        agg.draft_seconds += t1 - t0
        agg.verify_seconds += time.perf_counter() - t1

    agg.total_seconds = time.perf_counter() - t_start
    return GenerationResult(tokens=out, metrics=agg)
