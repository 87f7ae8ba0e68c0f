"""Parameter containers of the drafter's Qwen3 blocks: RMSNorm and the SwiGLU MLP's projections.

Parameter names follow Hugging Face Qwen3 so checkpoints map one to one. The compute (norms, RoPE,
attention call, MLP) is the one Qwen3 layer, `specdec_kernels.qwen3`; `compile_pointwise` is its
switch for compiled pointwise ops (training: `TrainConfig.compile`).
"""

from __future__ import annotations

import torch
from specdec_kernels.qwen3 import compile_pointwise, default_ops, rms_norm
from torch import nn

__all__ = ["RMSNorm", "SwiGLU", "compile_pointwise", "rms_norm"]


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return default_ops().rms_norm(x, self.weight, self.eps)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); run by `specdec_kernels.qwen3.mlp` (fused gate/up)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
