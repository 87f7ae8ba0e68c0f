"""Fast runtime for CUDA: static KV caches, a plain Qwen3 forward, CUDA graphs, and greedy
decoding loops (DFlash, host n-gram, plain AR) with no host sync inside a round.

Entry points: `build_decoder` (weights from HF/our modules) and `loop.fast_generate`.
"""

from __future__ import annotations

import torch

from .drafter import draft_weights
from .loop import FastDecoder, fast_generate
from .qwen3 import supports, target_weights

__all__ = ["FastDecoder", "build_decoder", "fast_generate", "supports"]


def build_decoder(target, drafter=None, *, batch: int, max_len: int, max_block: int = 16,
                  graphs: bool = True, dtype: torch.dtype | None = None,
                  attention: str = "auto", fuse_round: bool = False, prefill_bucket: int = 64,
                  invariant: bool = False) -> FastDecoder:
    """A decoder for an HF Qwen3 `target` and an optional `DFlashDraftModel`; `attention` is
    the backend of the decode/verify/draft steps: "sdpa" (torch), "triton" (`kernels`) or
    "auto" (triton on CUDA, sdpa elsewhere). `fuse_round`: one CUDA graph per round (draft +
    verify + accept) instead of three, except in profiled rounds. `prefill_bucket`: prompts are
    padded to a multiple of it (0 = not padded: every new prompt width is a new shape);
    `FastDecoder.warmup()` then covers every shape. `invariant`: batch-invariant matmuls and
    RMSNorm in the target (`loop.invariant_ops`) and attention plan ("triton" becomes
    "triton-invariant"), so a verify block computes each position as a 1-token decode step
    does (bf16 identity; Triton, so CUDA or the interpreter)."""
    tw = target_weights(target, dtype)
    dw = draft_weights(drafter, tw.embed.dtype) if drafter is not None else None
    return FastDecoder(tw, dw, batch, max_len, tw.embed.device, max_block, graphs, attention,
                       fuse_round, prefill_bucket, invariant)
