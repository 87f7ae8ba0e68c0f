"""Proposers: anything that drafts the g tokens after an anchor for every row of a batch.

The verification loop (`generate.py`) only talks to this interface. `DFlashProposer` runs the
block-diffusion drafter; `ScriptedProposer` replays known continuations (shift 0: an oracle that
is always right; shift 1: a proposer that is always wrong), which pins tau to its bounds in tests.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .draft_cache import DraftKVCache
from .model import DFlashDraftModel
from .sampling import SamplingParams, sample_from, sampling_probs
from .target import TargetRunner


class Proposer(Protocol):
    layer_ids: tuple[int, ...]  # target layers whose outputs the proposer needs (may be empty)

    def start(self, runner: TargetRunner, ids: torch.Tensor, features: torch.Tensor | None,
              positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Prompt context: ids/positions/valid [batch, prompt] (left-padded), features
        [batch, prompt, F] or None."""

    def propose(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, g: int,
                params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """anchor_ids/anchor_pos [batch] -> draft ids [batch, g], draft probs [batch, g, V] or
        None for a deterministic proposer."""

    def observe(self, ids: torch.Tensor, features: torch.Tensor | None, positions: torch.Tensor,
                keep: torch.Tensor) -> None:
        """The verified block: ids/positions/keep [batch, block] (keep = committed to the target
        cache), features [batch, block, F] or None."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished rows leave)."""


class DFlashProposer:
    def __init__(self, drafter: DFlashDraftModel):
        self.drafter = drafter
        self.layer_ids = drafter.config.target_layer_ids
        self.mask_id = drafter.config.mask_token_id

    def start(self, runner, ids, features, positions, valid):
        self.runner = runner
        self.cache = DraftKVCache(len(self.drafter.layers))
        self.pending = (features, positions, valid)

    def propose(self, anchor_ids, anchor_pos, g, params, generator):
        logits = self.draft_logits(anchor_ids, anchor_pos, g)  # [batch, g, vocab]
        if params.greedy:
            return logits.argmax(-1), None
        q = sampling_probs(logits, params)
        return sample_from(q, generator), q

    def draft_logits(self, anchor_ids, anchor_pos, g):  # -> [batch, g, vocab]
        """One drafter forward over [anchor, g masks]: its logits at block positions 1..g."""
        b = anchor_ids.shape[0]
        block = torch.cat([anchor_ids[:, None], anchor_ids.new_full((b, g), self.mask_id)], 1)
        positions = anchor_pos[:, None] + torch.arange(g + 1, device=anchor_ids.device)
        dtype = self.drafter.fc.weight.dtype
        embeds = self.runner.embed(block).to(dtype)
        feats, ctx_pos, ctx_valid = self.pending
        hidden = self.drafter(embeds, positions, feats, ctx_pos, ctx_valid, self.cache)
        self.pending = (None, None, None)
        self.cache.compact()
        head_dtype = self.runner.model.get_output_embeddings().weight.dtype
        return self.runner.lm_head(hidden[:, 1:].to(head_dtype))

    def observe(self, ids, features, positions, keep):
        self.pending = (features, positions, keep)

    def select_rows(self, rows):
        self.cache.select_rows(rows)
        feats, pos, valid = self.pending
        if feats is not None:
            self.pending = (feats[rows], pos[rows], valid[rows])


class ScriptedProposer:
    """Proposes `(continuation[row][i] + shift) % vocab` for generated index i of each row."""

    layer_ids: tuple[int, ...] = ()

    def __init__(self, continuations: list[list[int]], prompt_lens: list[int], vocab: int,
                 shift: int = 0):
        self.continuations = continuations
        self.prompt_lens = list(prompt_lens)
        self.rows = list(range(len(continuations)))
        self.vocab, self.shift = vocab, shift

    def start(self, runner, ids, features, positions, valid):
        self.rows = list(range(len(self.continuations)))

    def propose(self, anchor_ids, anchor_pos, g, params, generator):
        out = []
        for row, pos in zip(self.rows, anchor_pos.tolist()):
            first = pos - self.prompt_lens[row] + 1  # generated index of the first drafted token
            ref = self.continuations[row][first:first + g]
            ref = ref + [0] * (g - len(ref))
            out.append([(t + self.shift) % self.vocab for t in ref])
        return torch.tensor(out, dtype=torch.long, device=anchor_ids.device), None

    def observe(self, ids, features, positions, keep):
        pass

    def select_rows(self, rows):
        self.rows = [self.rows[i] for i in rows.tolist()]
