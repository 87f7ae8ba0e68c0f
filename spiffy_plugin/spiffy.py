"""Spiffy: lossless speculative decoding of a block-diffusion LM with a calibrated draft graph.

Each forward scores the *root* (the current block after the latest step) together with up to D*
draft blocks built from the distribution P that produced the root (`graph.py` defines the
formulas). Each draft sees the committed context and itself only. Verification then replays the
decoder: the true next state is chosen from the root's distribution exactly as vanilla decoding
would (same rule, same random stream); if it equals a draft, that draft's distribution, already
computed in this forward, gives the following step, and its children are checked the same way.
So one forward advances 1 + (accepted depth) steps, and the output equals vanilla decoding's.
*Branches* of a verification forward: 0 = the root, 1.. = the kept drafts; each has a parent
branch (`branch_parents`), which SpecFold's pluggable verify forward (`Verify`) may exploit.
`replay` (that acceptance rule) and `next_drafts` (build + prune) are the one implementation,
called by `spiffy_generate` here and by the SGLang adapter (`engines/sglang_drafts.advance`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from specdec_kernels.sampling import ban_tokens

from .decode import DLLMResult, choose_unmask, start_decoding, step_distribution
from .errors import require
from .graph import DraftGraph, Node, geometric_mean, is_parent
from .params import DecodeParams
from .runtime import BlockDiffusionRunner, dllm_spec

# (runner, blocks [k, block] with the root first, parent branch of each [k]) -> [k, block, vocab]
Verify = Callable[[BlockDiffusionRunner, torch.Tensor, list[int]], torch.Tensor]


def dense_verify(runner: BlockDiffusionRunner, blocks: torch.Tensor,  # [k, block_size]
                 parents: list[int]) -> torch.Tensor:  # [k, block_size, vocab]
    """Spiffy's verification: every position of every branch computed in one forward."""
    return runner.forward(blocks[0, :0], blocks)


def branch_parents(graph: DraftGraph, kept: list[int]) -> list[int]:
    """Parent branch of each scored block: -1 for the root (branch 0); a kept draft's parent is
    its kept graph parent with the most pairs (the closest state; the earlier branch on ties),
    or the root at depth 1. `prune` keeps a parent before its child, so parents[i] < i."""
    out = [-1]
    for b, k in enumerate(kept, 1):
        node = graph.nodes[k]
        earlier = [a for a in range(1, b) if is_parent(graph.nodes[kept[a - 1]], node)]
        out.append(max(earlier, key=lambda a: (len(graph.nodes[kept[a - 1]].pairs), -a))
                   if earlier else 0)
    return out


@dataclass
class Ranks:
    """Ranks of P restricted to the root's decodable positions."""
    positions: list[int]  # block offsets, most confident first
    tokens: torch.Tensor  # [block, max_rank] token ids, most probable first
    token_probs: torch.Tensor  # [block, max_rank]


def rank_tables(probs: torch.Tensor, decodable: torch.Tensor, max_rank: int) -> Ranks:
    conf = probs.max(-1).values.masked_fill(~decodable.to(probs.device), -1.0)
    order = torch.argsort(conf, descending=True, stable=True)
    positions = order[: int(decodable.sum())].tolist()
    top = torch.topk(probs, max_rank, dim=-1)
    return Ranks(positions, top.indices, top.values)


def materialize(node: Node, root: torch.Tensor, ranks: Ranks) -> tuple[torch.Tensor, float] | None:
    """The node's block ids and the geometric mean of its tokens' probabilities under P, or None
    when a rank is out of range for this root."""
    ids = root.clone()
    probs = []
    for i, j in node.pairs:
        if i >= len(ranks.positions) or j >= ranks.tokens.shape[1]:
            return None
        pos = ranks.positions[i]
        ids[pos] = ranks.tokens[pos, j]
        probs.append(float(ranks.token_probs[pos, j]))
    return ids, geometric_mean(probs)


def prune(graph: DraftGraph, own: dict[int, float], keep: int) -> list[int]:
    """Keep `keep` nodes: score = gmean(own score, best child's score), computed bottom-up; a node
    is only kept when it is at depth 1 or one of its parents is kept."""
    score: dict[int, float] = {}
    for k in sorted(own, key=lambda k: -graph.nodes[k].depth):
        kids = [score[c] for c in graph.children(graph.nodes[k]) if c in score]
        score[k] = own[k] if not kids else geometric_mean([own[k], max(kids)])
    chosen: list[int] = []
    while len(chosen) < keep:
        frontier = [k for k in score if k not in chosen and (
            graph.nodes[k].depth == 1 or any(k in graph.children(graph.nodes[p]) for p in chosen))]
        if not frontier:
            break
        chosen.append(max(frontier, key=lambda k: (score[k], -k)))
    return chosen


def max_rank(graph: DraftGraph) -> int:
    """Token ranks the graph's nodes reach (1 + the largest rank j of any pair)."""
    return 1 + max((j for n in graph.nodes for _, j in n.pairs), default=0)


@dataclass
class Replay:
    steps: int  # denoising steps applied: 1 + the drafts accepted (each saved one forward)
    probs: torch.Tensor  # [block, vocab] the distribution the last step was chosen from
    decodable: torch.Tensor  # [block] bool: positions still decodable after the last step
    match: int | None  # draft row equal to the final canvas (a child of the last node), or None


def replay(
    ids: torch.Tensor,  # [block] the canvas the root scored; advanced in place
    root_logits: torch.Tensor,  # [block, vocab] the root's logits
    drafts: Sequence[tuple[int, torch.Tensor]],  # (graph node index, ids [block]), in row order
    draft_logits: torch.Tensor | None,  # [len(drafts), block, vocab] scored in the same forward
    graph: DraftGraph,
    params: DecodeParams,
    generator: torch.Generator | None,
    decodable: Callable[[torch.Tensor], torch.Tensor],  # ids [block] -> [block] bool
    banned: Sequence[int] = (),  # token ids set to -inf first (where the logits still allow them)
) -> Replay:
    """Spiffy's acceptance rule: take the decoder's step from the root's distribution (the rule
    of `params`, one `choose_unmask` per step from `generator`, as vanilla decoding does); while
    the new canvas equals a scored child draft of the current node and positions remain, take
    the next step from that draft's logits. Lossless: every step is the one vanilla decoding
    would take, whichever logits row it reads."""
    node, logits = None, root_logits
    steps = 0
    while True:
        logits = logits.float()
        if banned:
            logits = ban_tokens(logits.clone(), banned)
        probs = step_distribution(logits, params)
        pos, toks = choose_unmask(probs, decodable(ids), params, generator)
        ids[pos.to(ids.device)] = toks.to(ids.device, ids.dtype)
        steps += 1
        dec = decodable(ids)
        kids = set(graph.children(node))
        match = next((r for r, (k, d) in enumerate(drafts)
                      if k in kids and torch.equal(d, ids.to(d.device))), None)
        if not dec.any() or match is None:
            return Replay(steps, probs, dec, match)
        node, logits = graph.nodes[drafts[match][0]], draft_logits[match]


def next_drafts(
    graph: DraftGraph,
    ids: torch.Tensor,  # [block] the new root canvas
    probs: torch.Tensor,  # [block, vocab] P, the distribution that produced it
    decodable: torch.Tensor,  # [block] bool
    keep: int,  # D*
) -> list[tuple[int, torch.Tensor]]:  # (graph node index, ids [block] on ids' device), kept
    """The drafts to score with the next forward: every node materialized under P, pruned to
    `keep`."""
    ranks = rank_tables(probs, decodable, max_rank(graph))
    built = {k: materialize(n, ids.cpu(), ranks) for k, n in enumerate(graph.nodes)}
    own = {k: v[1] for k, v in built.items() if v is not None}
    return [(k, built[k][0].to(ids.device)) for k in prune(graph, own, keep)]


@torch.inference_mode()
def spiffy_generate(model, prompt: list[int], graph: DraftGraph,
                    params: DecodeParams = DecodeParams(), max_new_tokens: int = 128,
                    keep: int | None = None, verify: Verify = dense_verify) -> DLLMResult:
    """Spiffy decoding; identical output to `decode.generate` with the same params and seed
    (with the default dense `verify`; another verify forward may approximate the drafts)."""
    spec = dllm_spec(model.config)
    graph.check_model(spec.block_size, spec.vocab_size)
    keep = len(graph.nodes) if keep is None else keep
    require(1 <= keep <= len(graph.nodes), "keep",
            f"D* must be in [1, D={len(graph.nodes)}], got {keep}")
    st, logits = start_decoding(model, prompt, params, max_new_tokens)
    steps = 0
    drafts: list[tuple[int, torch.Tensor]] = []  # (graph node index, ids) scored in `logits`
    while True:
        block = st.block  # `block.decodable()` reads `block.ids`, which `replay` advances
        r = replay(block.ids, logits[0], drafts, logits[1:], graph, params, st.generator,
                   lambda _ids, b=block: b.decodable())
        steps += r.steps
        if r.decodable.any():
            drafts = next_drafts(graph, block.ids, r.probs, r.decodable, keep)
            cands = torch.stack([block.ids] + [d for _, d in drafts])
            logits = verify(st.runner, cands, branch_parents(graph, [k for k, _ in drafts]))
            continue
        done = st.finish_block(steps)
        if done is not None:
            return done
        drafts = []
        logits = st.next_block()
