"""The DFlash drafter: Qwen3 decoder layers with target-context KV injection.

Context features (the target's hidden states at `target_layer_ids`, concatenated) are fused by
`fc` + `hidden_norm`. In every draft layer they pass through that layer's own `k_proj`/`v_proj`
(+ `k_norm`, RoPE at their absolute positions) and sit in front of the block's own K/V. Queries
come only from the block `[anchor, MASK x (B - 1)]`; attention inside the block is bidirectional
and sees all context. The drafter has no embedding or LM head: both are the target's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .config import DFlashConfig
from .draft_cache import DraftKVCache
from .layers import RMSNorm, SwiGLU, rope_cos_sin, rope_op


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, d)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project_kv(
        self,
        x: torch.Tensor,  # [batch, seq, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [batch, 1, seq, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # k, v [batch, kv_heads, seq, head_dim]
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rope_op(k, *rope), v

    def forward(
        self,
        x: torch.Tensor,  # [batch, block, hidden] (already input-normed)
        rope: tuple[torch.Tensor, torch.Tensor],  # block cos/sin [batch, 1, block, head_dim]
        ctx_k: torch.Tensor,  # [batch, kv_heads, ctx, head_dim]
        ctx_v: torch.Tensor,
        key_mask: torch.Tensor | None,  # [batch, 1, block, ctx + block] bool, True = visible
    ) -> torch.Tensor:  # [batch, block, hidden]
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim)).transpose(1, 2)
        q = rope_op(q, *rope)
        k_blk, v_blk = self.project_kv(x, rope)
        k = torch.cat([ctx_k, k_blk], dim=2)
        v = torch.cat([ctx_v, v_blk], dim=2)
        gqa = self.num_heads != self.num_kv_heads
        if gqa and key_mask is not None and q.is_cuda:
            # CUDA's fused kernels take an arbitrary mask only without enable_gqa.
            rep = self.num_heads // self.num_kv_heads
            k, v, gqa = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask,
                                             scale=self.head_dim ** -0.5, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


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

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

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
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            if context is not None:
                ctx_k, ctx_v = attn.project_kv(fused, ctx_rope)
                if cache is not None:
                    ctx_k, ctx_v = cache.append(i, ctx_k, ctx_v)
            elif cache is not None and cache.keys[i] is not None:
                ctx_k, ctx_v = cache.keys[i], cache.values[i]
            else:
                ctx_k = ctx_v = h.new_zeros(b, attn.num_kv_heads, 0, attn.head_dim)
            h = h + attn(layer.input_layernorm(h), block_rope, ctx_k, ctx_v, key_mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
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
        for layer in self.layers:
            attn = layer.self_attn
            ctx_k, ctx_v = attn.project_kv(fused, ctx_rope)  # [batch, kv_heads, L, head_dim]
            ctx_k = ctx_k[:, None].expand(b, a, *ctx_k.shape[1:]).reshape(b * a, *ctx_k.shape[1:])
            ctx_v = ctx_v[:, None].expand(b, a, *ctx_v.shape[1:]).reshape(b * a, *ctx_v.shape[1:])
            h = h + attn(layer.input_layernorm(h), block_rope, ctx_k, ctx_v, key_mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h).reshape(b, s, hidden)
