"""The target side of the reference runtime: any Hugging Face causal LM with hidden states.

`TargetRunner` keeps the target's KV cache for a batch of ragged rows. Slots of rejected draft
tokens are marked invalid and squeezed out (`compact`), so every row's cache holds exactly its
committed tokens. Positions are passed explicitly, so left padding and holes never shift RoPE.
Features are the concatenated hidden states at `layer_ids` (HF `hidden_states[id + 1]`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from .draft_cache import compact_slots, gather_slots
from .errors import require


def context_features(hidden_states: tuple[torch.Tensor, ...], layer_ids) -> torch.Tensor:
    """[batch, seq, len(layer_ids) * hidden] from HF `hidden_states` (index 0 = embeddings)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


class TargetRunner:
    def __init__(self, model: Any, layer_ids: tuple[int, ...] = ()):
        n_layers = model.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i < n_layers]
        require(not bad, "target_layer_ids", f"{bad} outside the target's layers [0, {n_layers})")
        self.model = model
        self.layer_ids = tuple(layer_ids)
        self.cache: DynamicCache | None = None
        self.valid: torch.Tensor | None = None  # [batch, slots] bool

    @property
    def config(self):
        return self.model.config

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [batch, seq] -> [batch, seq, hidden]
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        return self.model.get_output_embeddings()(hidden)

    def _forward(self, ids, positions, new_valid, attention_mask=None):
        mask = new_valid if self.valid is None else torch.cat([self.valid, new_valid], dim=1)
        out = self.model(
            input_ids=ids, position_ids=positions,
            attention_mask=mask.to(torch.long) if attention_mask is None else attention_mask,
            past_key_values=self.cache, use_cache=True,
            output_hidden_states=bool(self.layer_ids),
        )
        self.valid = mask
        feats = context_features(out.hidden_states, self.layer_ids) if self.layer_ids else None
        return out.logits, feats

    def prefill(
        self,
        ids: torch.Tensor,  # [batch, prompt] left-padded
        valid: torch.Tensor,  # [batch, prompt] bool, False on padding
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [batch, prompt, vocab], features
        self.cache = DynamicCache(config=self.model.config)
        self.valid = None
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        return self._forward(ids, positions, valid)

    def verify(
        self,
        ids: torch.Tensor,  # [batch, block]
        positions: torch.Tensor,  # [batch, block]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [batch, block, vocab], features
        return self._forward(ids, positions, torch.ones_like(ids, dtype=torch.bool))

    def verify_tree(
        self,
        ids: torch.Tensor,  # [batch, n + 1] anchor, then the tree's nodes
        positions: torch.Tensor,  # [batch, n + 1] anchor position + depth
        visible: torch.Tensor,  # [batch, n + 1, n + 1] bool: ancestor-or-self (`tree.tree_mask`)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits [batch, n + 1, vocab], features
        """One forward over a token tree: each node sees the committed cache and its ancestors
        (a 4D additive mask, which Hugging Face models take as given)."""
        b, q = ids.shape
        past = self.valid[:, None, :].expand(b, q, self.valid.shape[1])
        sees = torch.cat([past, visible], dim=-1)[:, None]  # [batch, 1, n + 1, slots + n + 1]
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = torch.zeros(sees.shape, dtype=dtype, device=ids.device)
        mask.masked_fill_(~sees, torch.finfo(dtype).min)
        return self._forward(ids, positions, torch.ones_like(ids, dtype=torch.bool), mask)

    def commit(self, keep: torch.Tensor) -> None:  # [batch, block] bool: slots to keep
        """Keep the accepted slots of the last verified block, drop the rest."""
        self.valid[:, -keep.shape[1]:] = keep
        self.compact()

    def compact(self) -> None:
        if bool(self.valid.all()):
            return
        index, self.valid = compact_slots(self.valid)
        for layer in self.cache.layers:
            layer.keys = gather_slots(layer.keys, index)
            layer.values = gather_slots(layer.values, index)

    def select_rows(self, rows: torch.Tensor) -> None:  # [kept] long
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        self.compact()
