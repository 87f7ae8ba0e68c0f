"""Random anchors and the packed block attention of the training recipe.

An *anchor* is a response position whose token is given clean; its block is the anchor followed by
B - 1 MASK tokens at positions anchor+1 .. anchor+B-1, trained to predict the tokens there. All
blocks of a sequence share one forward: block j sees the target context strictly before its
anchor plus its own B tokens (bidirectionally), and nothing of other blocks. Offset k = 1..B-1 of
a block is weighted w_k = exp(-(k - 1) / gamma). Inactive (padding) anchors are -1.
"""

from __future__ import annotations

import torch

from ..errors import require


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:  # [block_size]
    """Weight per block offset: 0 for the anchor (offset 0), exp(-(k - 1) / gamma) for k >= 1."""
    require(gamma > 0, "gamma", f"must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(
    response_start: int,
    length: int,
    num_anchors: int,
    generator: torch.Generator,
) -> torch.Tensor:  # [num_anchors] long, sorted, -1 = inactive
    """Draw distinct anchors uniformly from [response_start, length - 2] (each has a label)."""
    lo, hi = max(response_start, 0), length - 2
    n = max(hi - lo + 1, 0)
    out = torch.full((num_anchors,), -1, dtype=torch.long)
    if n == 0:
        return out
    take = min(n, num_anchors)
    pick = torch.randperm(n, generator=generator)[:take] + lo
    out[:take] = pick.sort().values
    return out


def block_mask(
    anchors: torch.Tensor,  # [batch, A] long, -1 = inactive
    block_size: int,
    ctx_len: int,
) -> torch.Tensor:  # [batch, 1, A * B, ctx_len + A * B] bool, True = visible
    b, a = anchors.shape
    blk = torch.arange(a * block_size, device=anchors.device) // block_size  # [A*B]
    anchor_of_query = anchors[:, blk]  # [batch, A*B]
    ctx_visible = torch.arange(ctx_len, device=anchors.device)[None, None, :] < \
        anchor_of_query[:, :, None]  # inactive anchors (-1) see no context
    own_block = (blk[:, None] == blk[None, :])[None].expand(b, -1, -1)
    return torch.cat([ctx_visible, own_block], dim=-1)[:, None]


def block_inputs(
    tokens: torch.Tensor,  # [batch, L] long (right-padded)
    lengths: torch.Tensor,  # [batch] valid length of each row
    anchors: torch.Tensor,  # [batch, A] long, -1 = inactive
    block_size: int,
    mask_token_id: int,
    weights: torch.Tensor,  # [block_size] per-offset loss weights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block ids, positions, labels and loss weights, each [batch, A * B]."""
    b, a = anchors.shape
    offs = torch.arange(block_size, device=tokens.device)
    pos = anchors.clamp_min(0)[:, :, None] + offs  # [batch, A, B]
    ids = torch.full_like(pos, mask_token_id)
    ids[:, :, 0] = tokens.gather(1, anchors.clamp_min(0))
    in_range = (pos < lengths[:, None, None]) & (anchors[:, :, None] >= 0)
    labels = tokens.gather(1, pos.clamp_max(tokens.shape[1] - 1).reshape(b, -1)).view(b, a, -1)
    w = weights.to(tokens.device)[None, None, :] * in_range
    flat = (b, a * block_size)
    return ids.reshape(flat), pos.reshape(flat), labels.reshape(flat), w.reshape(flat)

