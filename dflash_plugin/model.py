"""The DFlash drafter: Qwen3 decoder layers with target-context KV injection.

Context features (the target's hidden states at `target_layer_ids`, concatenated) are fused by
`fc` + `hidden_norm`. In every draft layer they pass through that layer's own `k_proj`/`v_proj`
(+ `k_norm`, RoPE at their absolute positions) and sit in front of the block's own K/V. Queries
come only from the block `[anchor, MASK x (B - 1)]`; attention inside the block is bidirectional
and sees all context. The drafter has no embedding or LM head: both are the target's.
"""

from __future__ import annotations

import torch
from specdec_kernels.qwen3 import LayerWeights, context_kv, decoder_layer, layer_weights
from specdec_kernels.rope import rope_cos_sin
from torch import nn
from torch.nn import functional as F

from .config import DFlashConfig
from .draft_cache import DraftKVCache
from .layers import RMSNorm, SwiGLU


class DraftAttention(nn.Module):
    """Parameters of one draft layer's attention (HF Qwen3 names)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        heads, kv_heads, bias = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias
        self.q_proj = nn.Linear(h, heads * d, bias=bias)
        self.k_proj = nn.Linear(h, kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def project_context(
    w: LayerWeights,
    fused: torch.Tensor,  # [batch, ctx, hidden] fused target features
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [batch, ctx, 1, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # k, v [batch, kv_heads, ctx, head_dim]
    k, v = context_kv(w, fused, rope)
    return k.transpose(1, 2), v.transpose(1, 2)


def injected_attention(
    ctx_k: torch.Tensor,  # [batch, kv_heads, ctx, head_dim] context K/V (KV injection)
    ctx_v: torch.Tensor,
    key_mask: torch.Tensor | None,  # [batch, 1, block, ctx + block] bool, True = visible
):
    """The drafter's `attend` hook: the block's queries over context K/V + the block's own."""
    def attend(q, k, v):  # [batch, block, heads | kv_heads, head_dim]
        q = q.transpose(1, 2)
        k = torch.cat([ctx_k, k.transpose(1, 2)], dim=2)
        v = torch.cat([ctx_v, v.transpose(1, 2)], dim=2)
        heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[-1]
        gqa = heads != kv_heads
        if gqa and key_mask is not None and q.is_cuda:
            # CUDA's fused kernels take an arbitrary mask only without enable_gqa.
            k, v, gqa = (k.repeat_interleave(heads // kv_heads, 1),
                         v.repeat_interleave(heads // kv_heads, 1), False)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=d ** -0.5,
                                             enable_gqa=gqa)
        return out.transpose(1, 2).flatten(2)  # [batch, block, heads * head_dim]
    return attend


class DFlashDraftModel(nn.Module):
    """Drafter weights and forward. Names match the z-lab checkpoint format exactly."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.num_context_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """[batch, ctx, n_layers * hidden] target features -> [batch, ctx, hidden]."""
        return self.hidden_norm(self.fc(features))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):  # [batch, seq]
        """cos, sin [batch, seq, 1, head_dim] (broadcast over heads)."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
        return cos[..., None, :], sin[..., None, :]

    def layer_weights(self) -> list[LayerWeights]:
        """Each layer's weights for `decoder_layer`, concatenated anew (differentiable)."""
        return [layer_weights(m, fuse=False) for m in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,  # [batch, block, hidden] target embedding of [anchor, MASK..]
        block_positions: torch.Tensor,  # [batch, block]
        context: torch.Tensor | None,  # [batch, ctx, n_layers * hidden] new target features
        context_positions: torch.Tensor | None,  # [batch, ctx]
        context_valid: torch.Tensor | None,  # [batch, ctx] bool (padding = False)
        cache: DraftKVCache | None = None,  # when given, new context K/V are appended to it
        attn_mask: torch.Tensor | None = None,  # [batch, 1, block, ctx + block] bool override
    ) -> torch.Tensor:  # [batch, block, hidden] final-normed hidden states
        """Without `attn_mask` every block token sees all valid context and the whole block. The
        training recipe packs many blocks into one call and passes its own mask instead."""
        b, s, _ = block_embeds.shape
        dtype = block_embeds.dtype
        block_rope = self._rope(block_positions, dtype)
        if context is not None:
            fused = self.fuse_context(context.to(dtype))
            ctx_rope = self._rope(context_positions, dtype)
            if context_valid is None:
                context_valid = torch.ones(fused.shape[:2], dtype=torch.bool, device=fused.device)
            if cache is not None:
                cache.extend_valid(context_valid)
        valid = cache.valid if cache is not None else context_valid
        if valid is None:  # no context at all
            valid = torch.zeros(b, 0, dtype=torch.bool, device=block_embeds.device)
        if attn_mask is not None:
            key_mask = attn_mask
        else:
            key_mask = torch.cat([valid, valid.new_ones(b, s)], dim=1)[:, None, None, :]
            key_mask = key_mask.expand(b, 1, s, key_mask.shape[-1])
        h = block_embeds
        for i, w in enumerate(self.layer_weights()):
            if context is not None:
                ctx_k, ctx_v = project_context(w, fused, ctx_rope)
                if cache is not None:
                    ctx_k, ctx_v = cache.append(i, ctx_k, ctx_v)
            elif cache is not None and cache.keys[i] is not None:
                ctx_k, ctx_v = cache.keys[i], cache.values[i]
            else:
                ctx_k = ctx_v = h.new_zeros(b, w.kv_heads, 0, w.head_dim)
            h = decoder_layer(w, h, block_rope, injected_attention(ctx_k, ctx_v, key_mask))
        return self.norm(h)

    def forward_packed(
        self,
        block_embeds: torch.Tensor,  # [batch, A * B, hidden] A blocks of B tokens per row
        block_positions: torch.Tensor,  # [batch, A * B]
        context: torch.Tensor,  # [batch, L, n_layers * hidden] target features of the row
        anchors: torch.Tensor,  # [batch, A] long; -1 = inactive block
    ) -> torch.Tensor:  # [batch, A * B, hidden]
        """Training forward: block j of a row sees the row's context at positions < anchor_j and
        its own B tokens, nothing of other blocks. Same result as `forward` with the dense
        `training.anchors.block_mask`, but each block only attends over L + B keys."""
        b, s, hidden = block_embeds.shape
        a = anchors.shape[1]
        bs = s // a
        L = context.shape[1]
        dtype = block_embeds.dtype
        ctx_pos = torch.arange(L, device=context.device)[None].expand(b, L)
        fused = self.fuse_context(context.to(dtype))
        ctx_rope = self._rope(ctx_pos, dtype)
        block_rope = self._rope(block_positions.reshape(b * a, bs), dtype)
        visible = torch.arange(L, device=anchors.device)[None, None, :] < anchors[:, :, None]
        key_mask = torch.cat([visible.reshape(b * a, 1, 1, L),
                              visible.new_ones(b * a, 1, 1, bs)], dim=-1)
        h = block_embeds.reshape(b * a, bs, hidden)
        for w in self.layer_weights():
            ctx_k, ctx_v = project_context(w, fused, ctx_rope)  # [batch, kv_heads, L, head_dim]
            ctx_k = ctx_k[:, None].expand(b, a, *ctx_k.shape[1:]).reshape(b * a, *ctx_k.shape[1:])
            ctx_v = ctx_v[:, None].expand(b, a, *ctx_v.shape[1:]).reshape(b * a, *ctx_v.shape[1:])
            h = decoder_layer(w, h, block_rope, injected_attention(ctx_k, ctx_v, key_mask))
        return self.norm(h).reshape(b, s, hidden)
