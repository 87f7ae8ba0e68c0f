"""The DFlash drafter in the fast runtime: the same math as `model.DFlashDraftModel`, over a
static context cache whose slot index is the token position.

`context_write` projects target features of verified tokens into every draft layer's K/V cache
(all at once: one fused K/V matmul for all layers). `draft_block` runs the block
`[anchor, MASK x (q - 1)]`: its own K/V go to the slots right after the committed context (stale
slots, overwritten by the next `context_write`), and it attends over context + block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .attention import plan
from .cache import StaticKVCache
from .qwen3 import (
    LayerWeights,
    Shape,
    apply_rope,
    layer_forward,
    random_layer,
    rms_norm,
    rope_at,
)


@dataclass
class DraftWeights:
    shape: Shape
    layer_ids: tuple[int, ...]  # target layers whose outputs form the context features
    mask_id: int
    fc: torch.Tensor  # [hidden, len(layer_ids) * target_hidden]
    hidden_norm: torch.Tensor  # [hidden]
    norm: torch.Tensor  # [hidden]
    layers: list[LayerWeights]
    w_ctx_kv: torch.Tensor  # [layers * 2 * kv_heads * head_dim, hidden]: every layer's k, v
    k_norms: torch.Tensor  # [layers, 1, head_dim]


def _ctx_parts(layers: list[LayerWeights], s: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    q_rows = s.heads * s.head_dim
    kv = [lw.wqkv[q_rows:] for lw in layers]  # k rows then v rows of each layer
    return torch.cat(kv), torch.stack([lw.k_norm for lw in layers])[:, None]


def draft_weights(drafter, dtype: torch.dtype | None = None) -> DraftWeights:
    """Read a `DFlashDraftModel` (weights copied once, fused)."""
    from .qwen3 import layer_weights

    cfg = drafter.config
    dtype = dtype or drafter.fc.weight.dtype
    s = Shape(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
              cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size,
              cfg.rms_norm_eps, cfg.rope_theta)
    layers = [layer_weights(m.self_attn, m.mlp, m.input_layernorm, m.post_attention_layernorm,
                            dtype) for m in drafter.layers]
    w_ctx, k_norms = _ctx_parts(layers, s)

    def w(t):
        return t.detach().to(dtype)
    return DraftWeights(s, tuple(cfg.target_layer_ids), cfg.mask_token_id, w(drafter.fc.weight),
                        w(drafter.hidden_norm.weight), w(drafter.norm.weight), layers, w_ctx,
                        k_norms)


def random_drafter(s: Shape, target_hidden: int, layer_ids: tuple[int, ...], dtype, device,
                   seed: int = 1) -> DraftWeights:
    """Random weights at a given shape (timing only)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = [random_layer(s, dtype, device, gen) for _ in range(s.layers)]
    w_ctx, k_norms = _ctx_parts(layers, s)
    fc = (torch.randn(s.hidden, len(layer_ids) * target_hidden, generator=gen, device=device)
          * 0.02).to(dtype)
    ones = torch.ones(s.hidden, dtype=dtype, device=device)
    return DraftWeights(s, tuple(layer_ids), 0, fc, ones, ones.clone(), layers, w_ctx, k_norms)


def context_write(
    dw: DraftWeights,
    cache: StaticKVCache,
    rope_tab: tuple[torch.Tensor, torch.Tensor],  # drafter cos, sin [max_len, head_dim]
    feats: torch.Tensor,  # [batch, q, len(layer_ids) * target_hidden]
    positions: torch.Tensor,  # [batch, q] long
) -> None:
    s = dw.shape
    b, n, _ = feats.shape
    fused = rms_norm(F.linear(feats.to(dw.fc.dtype), dw.fc), dw.hidden_norm, s.eps)
    kv = F.linear(fused, dw.w_ctx_kv).view(b, n, s.layers, 2, s.kv_heads, s.head_dim)
    cos, sin = rope_at(rope_tab, positions)  # [batch, q, 1, head_dim]
    k = apply_rope(rms_norm(kv[:, :, :, 0], dw.k_norms, s.eps), cos[:, :, None], sin[:, :, None])
    # [batch, q, layers, kv_heads, head_dim] -> [layers, batch, kv_heads, q, head_dim]
    cache.write_all(k.permute(2, 0, 3, 1, 4), kv[:, :, :, 1].permute(2, 0, 3, 1, 4), positions)


def draft_block(
    dw: DraftWeights,
    cache: StaticKVCache,  # context K/V; cache.lengths = committed tokens = anchor positions
    rope_tab: tuple[torch.Tensor, torch.Tensor],
    embed: torch.Tensor,  # [vocab, target_hidden] the target's embedding
    lm_head: torch.Tensor,  # [vocab, target_hidden] the target's LM head
    anchor: torch.Tensor,  # [batch] long
    q: int,  # block length (anchor + q - 1 masks)
    attention: str = "sdpa",  # `attention.BACKENDS`
) -> torch.Tensor:  # [batch, q - 1] greedy draft ids
    s = dw.shape
    b = anchor.shape[0]
    ids = torch.cat([anchor[:, None], anchor.new_full((b, q - 1), dw.mask_id)], dim=1)
    positions = cache.lengths[:, None] + torch.arange(q, device=anchor.device)
    rope = rope_at(rope_tab, positions)
    # the committed context plus the whole block (bidirectional): one visible length per row
    attn = plan(attention, (cache.lengths + q)[:, None], cache.slots, s.heads // s.kv_heads)
    h = F.embedding(ids, embed).to(dw.fc.dtype)
    for i, lw in enumerate(dw.layers):
        h = layer_forward(lw, s, h, rope, cache, i, positions, attn)
    h = rms_norm(h[:, 1:], dw.norm, s.eps)
    return F.linear(h.to(lm_head.dtype), lm_head).argmax(-1)
