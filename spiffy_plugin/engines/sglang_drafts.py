"""Spiffy's acceptance rule on one SGLang canvas, free of SGLang (the engine-side batch is built
in `sglang_batch.py`).

A *canvas* is SGLang's current block of one request; the *root* is the canvas a forward scored,
the *drafts* are the guessed future canvases scored in the same forward (`spiffy.py` builds and
prunes them). `advance` runs the reference's acceptance replay (`spiffy.replay`, the one
implementation `spiffy.spiffy_generate` also calls) on the root's and the drafts' logits, keeps
the per-request counts, and builds the drafts for the next forward (`spiffy.next_drafts`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..params import DecodeParams
from ..spiffy import next_drafts, replay
from .sglang import SpiffyConfig, decodable_positions, request_seed


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
    params: DecodeParams | None = None,  # this request's params (sampled); None: cfg.params
    generator: torch.Generator | None = None,  # this request's random stream (sampled params)
) -> Outcome:
    """Apply as many denoising steps as this forward's rows verify; set `state.drafts`. When the
    final canvas is itself a scored draft (and `final_from_draft`), that row's K/V can stand in
    for the forward that would persist it: `Outcome(True, row)`; the caller copies them.
    Sampled params draw each step's tokens from `generator`, one `choose_unmask` per step as the
    reference decoder does (`spiffy.replay`), so the same stream gives the reference's tokens."""
    params = cfg.params if params is None else params
    state.forwards += 1
    state.drafts, state.root = [], None
    dec = _decodable(ids, state.prompt, cfg)
    if not dec.any():  # this forward scored the final canvas: its K/V are persisted
        state.done = True
        return Outcome(True, None)
    r = replay(ids, root_logits, [(d.node, d.ids) for d in scored], draft_logits, cfg.graph,
               params, generator, lambda canvas: _decodable(canvas, state.prompt, cfg),
               cfg.banned_token_ids)
    state.steps += r.steps
    state.accepted += r.steps - 1
    match = r.match
    if r.decodable.any():
        state.drafts = [Draft(k, d) for k, d in next_drafts(cfg.graph, ids, r.probs,
                                                            r.decodable, cfg.keep)]
        state.root = ids.clone()
        return Outcome(False, None)
    left = (ids == cfg.mask_id) & ~state.prompt.to(ids.device)
    if final_from_draft and match is not None and not left.any():  # a draft is the final canvas
        state.done = True
        return Outcome(True, match)
    if cfg.eos_token_id is not None:  # masks after a generated EOS become EOS (emitted canvas)
        ids.masked_fill_(left, cfg.eos_token_id)
    return Outcome(False, None)


class Streams:
    """Per-request random streams of sampled requests, kept across the request's blocks (SGLang
    drops an algorithm state when its block ends; the reference draws one request's whole
    generation from one generator). A stream is created on the device of the logits, seeded with
    the request's own seed when it gives one, else `request_seed(cfg seed, rid)`. It is dropped
    when a block ends in EOS; at most `capacity` are kept (least recently used go first). A
    request that comes back after its stream was dropped gets a new one seeded from its id and
    the block's start, never a replay of draws it already used."""

    def __init__(self, seed: int, capacity: int = 4096):
        self.seed, self.capacity = seed, capacity
        self.live: OrderedDict[object, torch.Generator] = OrderedDict()
        self.gone: OrderedDict[object, None] = OrderedDict()  # rids whose stream was dropped

    def get(self, rid, device: torch.device, seed: int | None, start: int) -> torch.Generator:
        g = self.live.get(rid)
        if g is not None and g.device == torch.device(device):
            self.live.move_to_end(rid)
            return g
        base = request_seed(self.seed, rid) if seed is None else seed
        if rid in self.gone or g is not None:
            base = request_seed(base, f"{rid}@{start}")
        g = torch.Generator(device=device).manual_seed(base)
        self.live[rid] = g
        self.live.move_to_end(rid)
        while len(self.live) > self.capacity:
            self.drop(next(iter(self.live)))
        return g

    def drop(self, rid) -> None:
        if self.live.pop(rid, None) is not None:
            self.gone[rid] = None
            while len(self.gone) > 16 * self.capacity:
                self.gone.popitem(last=False)
