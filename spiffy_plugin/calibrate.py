"""Offline calibration of a Spiffy draft graph.

Run the decoder on calibration prompts. After each step s (root = the state it produced, P = the
distribution it chose from), express the steps actually taken next (s+1, s+2, ... inside the same
block) as (position rank, token rank) pairs under P; the first k of them form the depth-k node
that would have predicted the state k steps later. Count nodes, then keep a connected subgraph of
`budget` nodes: by expected accepted depth on the recorded chains (`graph.select_by_depth`, the
default) or by degree-1 accumulated frequency (`graph.select_graph`). Deterministic for a fixed
seed.
"""

from __future__ import annotations

from collections import Counter

import torch
from tqdm import tqdm

from .decode import choose_unmask, start_decoding, step_distribution
from .errors import require
from .graph import DraftGraph, Node, check_selection, select_by_depth, select_graph
from .params import DecodeParams
from .runtime import dllm_spec


def rule_name(params: DecodeParams) -> str:
    if params.threshold is not None:
        return f"threshold-{params.threshold}"
    return f"vanilla-{params.unmask_per_step}"


def _pairs(step_positions, step_tokens, probs, root_decodable, max_rank):
    """Pairs of one later step under P = probs, or None if a rank exceeds max_rank."""
    conf = probs.max(-1).values.masked_fill(~root_decodable.to(probs.device), -1.0)
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
    st, logits = start_decoding(model, prompt, params, max_new_tokens)
    blocks, steps = [], []
    while True:
        block = st.block
        probs = step_distribution(logits[0], params)
        pos, toks = choose_unmask(probs, block.decodable(), params, st.generator)
        block.ids[pos] = toks.cpu()
        steps.append((probs, block.decodable(), pos.tolist(), toks.tolist()))
        if block.decodable().any():
            logits = st.runner.forward(block.ids[:0], block.ids[None])
            continue
        blocks.append(steps)
        steps = []
        if st.finish_block(0) is not None:
            return blocks
        logits = st.next_block()


def record_chains(blocks, max_depth: int, max_rank: int) -> list[list[Node]]:
    """Per step s of every block: the nodes that would have predicted the states 1, 2, ...
    steps later (each a parent of the next), up to max_depth or the first rank past max_rank."""
    chains = []
    for steps in blocks:
        for s, (probs, root_decodable, _, _) in enumerate(steps):
            pairs: list = []
            chain: list[Node] = []
            for k in range(1, max_depth + 1):
                if s + k >= len(steps):
                    break
                _, _, pos, toks = steps[s + k]
                step = _pairs(pos, toks, probs, root_decodable, max_rank)
                if step is None:
                    break
                pairs += step
                chain.append(Node.of(pairs, k))
            chains.append(chain)
    return chains


def count_nodes(blocks, max_depth: int, max_rank: int) -> Counter:
    return Counter(n for chain in record_chains(blocks, max_depth, max_rank) for n in chain)


def calibration_chains(model, prompts: list[list[int]], params: DecodeParams = DecodeParams(),
                       max_new_tokens: int = 128, max_depth: int = 6,
                       max_rank: int = 4) -> list[list[Node]]:
    """Run the decoder on every prompt (tqdm) and return all calibration chains."""
    chains: list[list[Node]] = []
    for p in tqdm(prompts, desc="calibrate", unit="prompt"):
        chains += record_chains(record_block_steps(model, p, params, max_new_tokens), max_depth,
                                max_rank)
    return chains


def graph_from_chains(chains: list[list[Node]], budget: int, spec, rule: str,
                      selection: str = "expected-depth") -> DraftGraph:
    check_selection(selection)
    counts = Counter(n for chain in chains for n in chain)
    chosen = select_by_depth(chains, budget) if selection == "expected-depth" else \
        select_graph(dict(counts), budget)
    return DraftGraph(tuple(chosen), tuple(counts[n] for n in chosen), spec.block_size,
                      spec.vocab_size, rule, selection)


def calibrate(model, prompts: list[list[int]], budget: int, params: DecodeParams = DecodeParams(),
              max_new_tokens: int = 128, max_depth: int = 6, max_rank: int = 4,
              selection: str = "expected-depth") -> DraftGraph:
    require(budget >= 1, "budget", f"must be >= 1, got {budget}")
    check_selection(selection)
    spec = dllm_spec(model.config)
    chains = calibration_chains(model, prompts, params, max_new_tokens, max_depth, max_rank)
    return graph_from_chains(chains, budget, spec, rule_name(params), selection)
