"""The DFlash drafter in the fast runtime: the same layers as `model.DFlashDraftModel`
(`specdec_kernels.qwen3`), over a static context cache whose slot index is the token position.

`context_write` projects target features of verified tokens into every draft layer's K/V cache
(KV injection: `qwen3.context_kv`). `draft_block` runs the block `[anchor, MASK x (q - 1)]`: its
own K/V go to the slots right after the committed context (stale slots, overwritten by the next
`context_write`), and it attends over context + block. `draft_logits` is the same forward with
the drafter's logits at block positions 1..q - 1; `draft_topk` their top-k log-probabilities
(the input of the tree build, `tree_build.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specdec_kernels.qwen3 import LayerWeights, Ops, context_kv, decoder_layer, layer_weights
from torch.nn import functional as F

from .attention import plan
from .cache import StaticKVCache
from .qwen3 import Shape, cache_attend, random_layer, rms_norm, rope_at


@dataclass
class DraftWeights:
    shape: Shape
    layer_ids: tuple[int, ...]  # target layers whose outputs form the context features
    mask_id: int
    fc: torch.Tensor  # [hidden, len(layer_ids) * target_hidden]
    hidden_norm: torch.Tensor  # [hidden]
    norm: torch.Tensor  # [hidden]
    layers: list[LayerWeights]


def draft_weights(drafter, dtype: torch.dtype | None = None) -> DraftWeights:
    """A `DFlashDraftModel`'s weights, fused once (in its dtype its parameters become views of
    the fused tensors, as for the target)."""
    cfg = drafter.config
    dtype = dtype or drafter.fc.weight.dtype
    s = Shape(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
              cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size,
              cfg.rms_norm_eps, cfg.rope_theta)

    def w(t):
        return t.detach().to(dtype)
    return DraftWeights(s, tuple(cfg.target_layer_ids), cfg.mask_token_id, w(drafter.fc.weight),
                        w(drafter.hidden_norm.weight), w(drafter.norm.weight),
                        [layer_weights(m, dtype) for m in drafter.layers])


def random_drafter(s: Shape, target_hidden: int, layer_ids: tuple[int, ...], dtype, device,
                   seed: int = 1) -> DraftWeights:
    """Random weights at a given shape (timing only)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = [random_layer(s, dtype, device, gen) for _ in range(s.layers)]
    fc = (torch.randn(s.hidden, len(layer_ids) * target_hidden, generator=gen, device=device)
          * 0.02).to(dtype)
    ones = torch.ones(s.hidden, dtype=dtype, device=device)
    return DraftWeights(s, tuple(layer_ids), 0, fc, ones, ones.clone(), layers)


def context_write(
    dw: DraftWeights,
    cache: StaticKVCache,
    rope_tab: tuple[torch.Tensor, torch.Tensor],  # drafter cos, sin [max_len, head_dim]
    feats: torch.Tensor,  # [batch, q, len(layer_ids) * target_hidden]
    positions: torch.Tensor,  # [batch, q] long
    ops: Ops | None = None,
) -> None:
    fused = rms_norm(F.linear(feats.to(dw.fc.dtype), dw.fc), dw.hidden_norm, dw.shape.eps)
    rope = rope_at(rope_tab, positions)  # [batch, q, 1, head_dim]
    for i, lw in enumerate(dw.layers):
        k, v = context_kv(lw, fused, rope, ops)  # [batch, q, kv_heads, head_dim]
        cache.write(i, k.transpose(1, 2), v.transpose(1, 2), positions)


def draft_block(
    dw: DraftWeights,
    cache: StaticKVCache,  # context K/V; cache.lengths = committed tokens = anchor positions
    rope_tab: tuple[torch.Tensor, torch.Tensor],
    embed: torch.Tensor,  # [vocab, target_hidden] the target's embedding
    lm_head: torch.Tensor,  # [vocab, target_hidden] the target's LM head
    anchor: torch.Tensor,  # [batch] long
    q: int,  # block length (anchor + q - 1 masks)
    attention: str = "sdpa",  # `attention.BACKENDS`
    ops: Ops | None = None,
) -> torch.Tensor:  # [batch, q - 1] greedy draft ids
    return draft_logits(dw, cache, rope_tab, embed, lm_head, anchor, q, attention, ops).argmax(-1)


def draft_topk(
    dw: DraftWeights,
    cache: StaticKVCache,
    rope_tab: tuple[torch.Tensor, torch.Tensor],
    embed: torch.Tensor,  # [vocab, target_hidden]
    lm_head: torch.Tensor,  # [vocab, target_hidden]
    anchor: torch.Tensor,  # [batch] long
    q: int,
    k: int,  # candidates per position
    attention: str = "sdpa",
    ops: Ops | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fp32 log-probs, ids [batch, q - 1, k] (best first)
    logits = draft_logits(dw, cache, rope_tab, embed, lm_head, anchor, q, attention, ops)
    return logits.float().log_softmax(-1).topk(k, dim=-1)


def draft_logits(
    dw: DraftWeights,
    cache: StaticKVCache,
    rope_tab: tuple[torch.Tensor, torch.Tensor],
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    anchor: torch.Tensor,  # [batch] long
    q: int,
    attention: str = "sdpa",
    ops: Ops | None = None,
) -> torch.Tensor:  # [batch, q - 1, vocab] the drafter's logits at block positions 1..q - 1
    s = dw.shape
    b = anchor.shape[0]
    ids = torch.cat([anchor[:, None], anchor.new_full((b, q - 1), dw.mask_id)], dim=1)
    positions = cache.lengths[:, None] + torch.arange(q, device=anchor.device)
    rope = rope_at(rope_tab, positions)
    # the committed context plus the whole block (bidirectional): one visible length per row
    attn = plan(attention, (cache.lengths + q)[:, None], cache.slots, s.heads // s.kv_heads)
    h = F.embedding(ids, embed).to(dw.fc.dtype)
    for i, lw in enumerate(dw.layers):
        h = decoder_layer(lw, h, rope, cache_attend(cache, i, positions, attn), ops)
    h = rms_norm(h[:, 1:], dw.norm, s.eps)
    return F.linear(h.to(lm_head.dtype), lm_head)
