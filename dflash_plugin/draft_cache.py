"""KV cache of the drafter: projected target context, one entry per committed token and layer.

Rows of a batch commit different numbers of tokens per round, so the cache is a padded tensor per
layer plus a `valid` mask over its slots. `compact` moves each row's valid slots to the right end
(left padding) so the cache never grows by more than one round's worth of holes.
"""

from __future__ import annotations

import torch


def compact_slots(
    valid: torch.Tensor,  # [batch, slots] bool
) -> tuple[torch.Tensor, torch.Tensor]:  # gather index [batch, kept], new valid [batch, kept]
    """Index that keeps each row's valid slots in order, right-aligned, with left padding."""
    counts = valid.sum(-1)  # [batch]
    kept = int(counts.max()) if valid.numel() else 0
    slots = valid.shape[1]
    # Sort key: invalid slots first (stable), valid slots after in their original order.
    order = torch.argsort(valid.to(torch.int8), dim=-1, stable=True)  # [batch, slots]
    index = order[:, slots - kept:]
    new_valid = torch.arange(kept, device=valid.device)[None, :] >= (kept - counts)[:, None]
    return index, new_valid


def gather_slots(
    x: torch.Tensor,  # [batch, heads, slots, dim]
    index: torch.Tensor,  # [batch, kept]
) -> torch.Tensor:  # [batch, heads, kept, dim]
    idx = index[:, None, :, None].expand(x.shape[0], x.shape[1], index.shape[1], x.shape[3])
    return x.gather(2, idx)


class DraftKVCache:
    """Per-layer context K/V of the drafter with a per-row validity mask."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.valid: torch.Tensor | None = None  # [batch, slots] bool

    def extend_valid(self, new_valid: torch.Tensor) -> None:  # [batch, new]
        self.valid = new_valid if self.valid is None else torch.cat([self.valid, new_valid], 1)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):  # [batch, kv_heads, new, d]
        """Append one layer's new context K/V; returns the layer's whole cached K/V."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def compact(self) -> None:
        """Drop padding holes left by ragged appends."""
        if self.valid is None or bool(self.valid.all()):
            return
        index, self.valid = compact_slots(self.valid)
        self.keys = [None if k is None else gather_slots(k, index) for k in self.keys]
        self.values = [None if v is None else gather_slots(v, index) for v in self.values]

    def select_rows(self, rows: torch.Tensor) -> None:  # [kept_rows] long
        """Keep only the given batch rows (finished requests leave the batch)."""
        if self.valid is None:
            return
        self.valid = self.valid[rows]
        self.keys = [None if k is None else k[rows] for k in self.keys]
        self.values = [None if v is None else v[rows] for v in self.values]
        self.compact()
