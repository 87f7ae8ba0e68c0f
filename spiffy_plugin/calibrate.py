"""Offline calibration of a Spiffy draft graph.

Run the decoder on calibration prompts. After each step s (root = the state it produced, P = the
distribution it chose from), express the steps actually taken next (s+1, s+2, ... inside the same
block) as (position rank, token rank) pairs under P; the first k of them form the depth-k node
that would have predicted the state k steps later. Count nodes, then keep a connected subgraph of
`budget` nodes (`graph.select_graph`). Deterministic for a fixed seed.
"""

from __future__ import annotations

from collections import Counter

import torch
from tqdm import tqdm

from .decode import BlockState, choose_unmask, step_distribution, validate_prompt
from .graph import DraftGraph, Node, select_graph
from .params import DecodeParams
from .runtime import BlockDiffusionRunner, dllm_spec


def rule_name(params: DecodeParams) -> str:
    if params.threshold is not None:
        return f"threshold-{params.threshold}"
    return f"vanilla-{params.unmask_per_step}"


def _pairs(step_positions, step_tokens, probs, root_decodable, max_rank):
    """Pairs of one later step under P = probs, or None if a rank exceeds max_rank."""
    conf = probs.max(-1).values.masked_fill(~root_decodable, -1.0)
    pos_rank = {p: r for r, p in enumerate(torch.argsort(conf, descending=True, stable=True)
                                           .tolist())}
    out = []
    for p, t in zip(step_positions, step_tokens):
        j = int((probs[p] > probs[p, t]).sum())
        if pos_rank[p] >= int(root_decodable.sum()) or j >= max_rank:
            return None
        out.append((pos_rank[p], j))
    return out


@torch.inference_mode()
def record_block_steps(model, prompt: list[int], params: DecodeParams, max_new_tokens: int):
    """Run the decoder; per block, the list of (probs, root decodable mask, positions, tokens)
    of each step, in order."""
    spec = dllm_spec(model.config)
    validate_prompt(prompt, max_new_tokens, spec)
    gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    runner = BlockDiffusionRunner(model, spec)
    bs, mask, p_len = spec.block_size, spec.mask_token_id, len(prompt)
    start = (p_len // bs) * bs
    ids = torch.full((bs,), mask, dtype=torch.long)
    ids[: p_len - start] = torch.tensor(prompt[start:], dtype=torch.long)
    block = BlockState(ids, start, p_len, p_len + max_new_tokens, spec)
    logits = runner.forward(torch.tensor(prompt[:start], dtype=torch.long), ids[None])[0]
    blocks, steps, produced = [], [], 0
    while True:
        probs = step_distribution(logits, params)
        pos, toks = choose_unmask(probs, block.decodable(), params, gen)
        block.ids[pos] = toks.cpu()
        steps.append((probs, block.decodable(), pos.tolist(), toks.tolist()))
        if block.decodable().any():
            logits = runner.forward(block.ids[:0], block.ids[None])[0]
            continue
        blocks.append(steps)
        produced += len(block.generated())
        eos = spec.eos_token_id
        if (eos is not None and eos in block.generated()) or produced >= max_new_tokens:
            return blocks
        nxt = torch.full((bs,), mask, dtype=torch.long)
        clean, steps = block.ids, []
        block = BlockState(nxt, block.start + bs, p_len, p_len + max_new_tokens, spec)
        logits = runner.forward(clean, nxt[None])[0]


def count_nodes(blocks, max_depth: int, max_rank: int) -> Counter:
    counts: Counter = Counter()
    for steps in blocks:
        for s, (probs, root_decodable, _, _) in enumerate(steps):
            pairs: list = []
            for k in range(1, max_depth + 1):
                if s + k >= len(steps):
                    break
                _, _, pos, toks = steps[s + k]
                step = _pairs(pos, toks, probs, root_decodable, max_rank)
                if step is None:
                    break
                pairs += step
                counts[Node.of(pairs, k)] += 1
    return counts


def calibrate(model, prompts: list[list[int]], budget: int, params: DecodeParams = DecodeParams(),
              max_new_tokens: int = 128, max_depth: int = 4, max_rank: int = 4) -> DraftGraph:
    spec = dllm_spec(model.config)
    counts: Counter = Counter()
    for p in tqdm(prompts, desc="calibrate", unit="prompt"):
        counts += count_nodes(record_block_steps(model, p, params, max_new_tokens), max_depth,
                              max_rank)
    chosen = select_graph(dict(counts), budget)
    return DraftGraph(tuple(chosen), tuple(counts[n] for n in chosen), spec.block_size,
                      spec.vocab_size, rule_name(params))
