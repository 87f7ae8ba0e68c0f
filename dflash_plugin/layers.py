"""Qwen3 building blocks for the drafter: RMSNorm, rotary embedding (RoPE), SwiGLU MLP.

Parameter names follow Hugging Face Qwen3 so checkpoints map one to one. RoPE uses the
"rotate half" convention: the head dimension is split into two halves that rotate together.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return _ops["rms_norm"](x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., dim]
    """Same math as HF Qwen3RMSNorm: fp32 normalisation, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_ops["silu_mul"](self.gate_proj(x), self.up_proj(x)))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rope_cos_sin(
    positions: torch.Tensor,  # [batch, seq] absolute positions
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # each [batch, 1, seq, head_dim]
    """cos/sin tables of default RoPE at the given positions (fp32 math, cast to dtype)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float()
    inv_freq = 1.0 / (theta ** (exponent / head_dim))  # [head_dim / 2]
    freqs = positions.float()[..., None] * inv_freq  # [batch, seq, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(
    x: torch.Tensor,  # [batch, heads, seq, head_dim]
    cos: torch.Tensor,  # [batch, 1, seq, head_dim]
    sin: torch.Tensor,
) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_op(x, cos, sin):  # the dispatching form of `apply_rope` (see `compile_pointwise`)
    return _ops["apply_rope"](x, cos, sin)


POINTWISE = {"rms_norm": rms_norm, "silu_mul": silu_mul, "apply_rope": apply_rope}
_ops = dict(POINTWISE)  # what the drafter's modules call


def compile_pointwise(enabled: bool = True) -> None:
    """Opt-in (training: `TrainConfig.compile`): run the drafter's elementwise pieces through
    `torch.compile` (one fused kernel per piece, forward and backward, instead of several eager
    ones with fp32 round trips). Same math; `False` restores eager."""
    for name, fn in POINTWISE.items():
        _ops[name] = torch.compile(fn, dynamic=True) if enabled else fn
