"""Default rotary position embedding (RoPE), the "rotate half" convention of Hugging Face Qwen3.

The head dimension splits into two halves that rotate together: x' = x * cos + rotate_half(x) *
sin, with rotate_half(x) = [-x2, x1]. *Tables* are cos and sin at given positions, computed in
fp32 and cast to the model dtype (the values of HF's `Qwen3RotaryEmbedding` at default RoPE).
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor,  # [...] absolute positions (any integer dtype)
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [..., head_dim] each
    """cos/sin tables of default RoPE at `positions` (fp32 math, then cast to `dtype`)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float()
    inv_freq = 1.0 / (theta ** (exponent / head_dim))  # [head_dim / 2]
    freqs = positions.float()[..., None] * inv_freq  # [..., head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_table(max_len: int, head_dim: int, theta: float, dtype: torch.dtype,
               device) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [max_len, head_dim]
    """`rope_cos_sin` at positions 0 .. max_len - 1 (index it with positions to look up)."""
    return rope_cos_sin(torch.arange(max_len, device=device), head_dim, theta, dtype)


def apply_rope(
    x: torch.Tensor,  # [..., head_dim]
    cos: torch.Tensor,  # broadcastable to x
    sin: torch.Tensor,  # broadcastable to x
) -> torch.Tensor:  # [..., head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
