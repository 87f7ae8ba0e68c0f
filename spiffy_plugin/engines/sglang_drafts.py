"""Spiffy's acceptance rule on one SGLang canvas, free of SGLang (the engine-side batch is built
in `sglang_batch.py`).

A *canvas* is SGLang's current block of one request; the *root* is the canvas a forward scored,
the *drafts* are the guessed future canvases scored in the same forward (`spiffy.py` builds and
prunes them). `advance` replays the graph's decoding rule from the root's logits, moving on to a
draft's logits whenever the next true canvas equals a scored child draft, exactly as
`spiffy.spiffy_generate` does; then it builds the drafts for the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..decode import choose_unmask, step_distribution
from ..spiffy import materialize, prune, rank_tables
from .sglang import SpiffyConfig, decodable_positions


@dataclass
class Draft:
    node: int  # index into the graph's nodes
    ids: torch.Tensor  # [block] the guessed canvas


@dataclass
class CanvasState:
    """Per-request algorithm state (SGLang's `algo_states` entry), kept across forwards."""
    prompt: torch.Tensor  # [block] bool: positions the prompt owns
    drafts: list[Draft] = field(default_factory=list)  # to score with the next forward
    root: torch.Tensor | None = None  # [block] the canvas `drafts` were built on
    forwards: int = 0  # forwards that scored this block so far
    steps: int = 0  # denoising steps applied to this block so far
    accepted: int = 0  # steps taken from a draft's logits (each saved one forward)
    done: bool = False


@dataclass
class Outcome:
    done: bool  # the canvas is final and its K/V are in the cache
    kv_from: int | None  # draft row (index into the scored drafts) holding the final canvas's K/V


def max_rank(cfg: SpiffyConfig) -> int:
    return 1 + max((j for n in cfg.graph.nodes for _, j in n.pairs), default=0)


def drafts_to_score(state: CanvasState, canvas: torch.Tensor) -> list[Draft]:  # canvas [block]
    """The drafts to score with `canvas`; none when the canvas is not the one they were built on
    (a request SGLang restarted), which only costs speed, never correctness."""
    if state.root is None or not torch.equal(state.root, canvas.to(state.root.device)):
        return []
    return state.drafts


def _decodable(ids: torch.Tensor, prompt: torch.Tensor, cfg: SpiffyConfig) -> torch.Tensor:
    return decodable_positions(ids[None], prompt[None], cfg.mask_id, cfg.eos_token_id)[0]


def advance(
    ids: torch.Tensor,  # [block] canvas the root row scored; advanced in place
    root_logits: torch.Tensor,  # [block, vocab] the root row's logits
    scored: list[Draft],  # the drafts scored in the same forward, in row order
    draft_logits: torch.Tensor | None,  # [len(scored), block, vocab]
    state: CanvasState,
    cfg: SpiffyConfig,
    final_from_draft: bool = True,
) -> Outcome:
    """Apply as many denoising steps as this forward's rows verify; set `state.drafts`. When the
    final canvas is itself a scored draft (and `final_from_draft`), that row's K/V can stand in
    for the forward that would persist it: `Outcome(True, row)`; the caller copies them."""
    state.forwards += 1
    state.drafts, state.root = [], None
    dec = _decodable(ids, state.prompt, cfg)
    if not dec.any():  # this forward scored the final canvas: its K/V are persisted
        state.done = True
        return Outcome(True, None)
    banned = list(cfg.banned_token_ids)
    node, logits, match = None, root_logits, None
    while True:
        logits = logits.float().clone()
        if banned:
            logits[:, banned] = float("-inf")
        probs = step_distribution(logits, cfg.params)
        pos, toks = choose_unmask(probs, dec, cfg.params, None)
        ids[pos.to(ids.device)] = toks.to(ids.device, ids.dtype)
        state.steps += 1
        dec = _decodable(ids, state.prompt, cfg)
        kids = set(cfg.graph.children(node))
        match = next((r for r, d in enumerate(scored) if d.node in kids
                      and torch.equal(d.ids, ids.to(d.ids.device))), None)
        if not dec.any() or match is None:
            break
        node, logits = cfg.graph.nodes[scored[match].node], draft_logits[match]
        state.accepted += 1
    if dec.any():
        ranks = rank_tables(probs, dec, max_rank(cfg))
        built = {k: materialize(n, ids.cpu(), ranks) for k, n in enumerate(cfg.graph.nodes)}
        own = {k: v[1] for k, v in built.items() if v is not None}
        state.drafts = [Draft(k, built[k][0].to(ids.device)) for k in prune(cfg.graph, own,
                                                                          cfg.keep)]
        state.root = ids.clone()
        return Outcome(False, None)
    left = (ids == cfg.mask_id) & ~state.prompt.to(ids.device)
    if final_from_draft and match is not None and not left.any():  # a draft is the final canvas
        state.done = True
        return Outcome(True, match)
    if cfg.eos_token_id is not None:  # masks after a generated EOS become EOS (emitted canvas)
        ids.masked_fill_(left, cfg.eos_token_id)
    return Outcome(False, None)
