"""Static KV caches of the fast runtime: slot index == absolute token position.

A row's *length* is the number of committed tokens (= the anchor's position). Slots below it hold
committed K/V; slots at or above it are stale (rejected drafts, padding, warm-up writes) and are
never visible: a query at position p sees slots <= p (target) or < length + block (drafter), and
every forward writes its own slots before attending. So "crop" is moving `lengths` back.
"""

from __future__ import annotations

import torch
from specdec_kernels.rope import rope_table  # noqa: F401  (the runtime's RoPE tables)


class StaticKVCache:
    """K/V of every layer for a fixed batch: [layers, batch, kv_heads, max_len, head_dim]."""

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # committed tokens
        self.slots = torch.arange(max_len, device=device)  # [max_len]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def write(
        self,
        layer: int,
        k: torch.Tensor,  # [batch, kv_heads, q, head_dim]
        v: torch.Tensor,  # [batch, kv_heads, q, head_dim]
        positions: torch.Tensor,  # [batch, q] long, < max_len
    ) -> None:
        """Store K/V at their positions (in place, graph-safe: no host sync, static shapes)."""
        idx = positions[:, None, :, None].expand(k.shape)
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)

    def commit(self, produced: torch.Tensor) -> None:  # [batch] long: tokens committed per row
        self.lengths += produced

    def crop(self, lengths: torch.Tensor) -> None:  # [batch] long, <= current lengths
        """Roll rows back to `lengths` committed tokens; nothing is erased."""
        self.lengths.copy_(torch.minimum(self.lengths, lengths))

    def reset(self, lengths: torch.Tensor) -> None:  # [batch] long
        self.lengths.copy_(lengths)
