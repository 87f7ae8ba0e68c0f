"""Block-diffusion runtime over a Hugging Face Qwen3-architecture checkpoint.

The sequence is cut into blocks of `block_size` tokens. Committed blocks are clean context, seen
block-causally, and their K/V are cached exactly. The *current* block (prompt tokens and MASKs)
attends bidirectionally to itself and to all committed context; its token at a masked position
is predicted at that same position (no shift). One forward (one NFE) can at once commit a newly
clean block (appending its K/V) and score one or more candidate blocks, each of which sees the
context and itself only: vanilla decoding scores one block, Spiffy scores the block + drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from specdec_kernels.sampling import ban_tokens
from transformers import DynamicCache

from .errors import require


@dataclass(frozen=True)
class DLLMSpec:
    block_size: int
    mask_token_id: int
    eos_token_id: int | None
    banned_token_ids: tuple[int, ...]  # never predicted (mask, pad)
    vocab_size: int
    max_positions: int


def dllm_spec(config: Any) -> DLLMSpec:
    """Read `dllm_block_size` / `mask_token_id` from a model config, with clear errors."""
    bs = getattr(config, "dllm_block_size", None)
    mask = getattr(config, "mask_token_id", None)
    require(bs is not None, "dllm_block_size", "missing from the model config: not a "
            "block-diffusion checkpoint")
    require(mask is not None, "mask_token_id", "missing from the model config")
    require(1 <= bs <= 256, "dllm_block_size", f"must be in [1, 256], got {bs}")
    require(0 <= mask < config.vocab_size, "mask_token_id",
            f"must be in [0, vocab_size={config.vocab_size}), got {mask}")
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    pad = getattr(config, "pad_token_id", None)
    banned = tuple(sorted({mask} | ({pad} if pad is not None and pad != eos else set())))
    return DLLMSpec(bs, mask, eos, banned, config.vocab_size, config.max_position_embeddings)


def candidate_mask(
    clean_len: int,  # new clean tokens in this forward (a multiple of block_size, or 0)
    num_blocks: int,  # candidate blocks scored in this forward
    block_size: int,
    cached: int,  # tokens already in the KV cache
) -> torch.Tensor:  # [q, cached + q] bool, q = clean_len + num_blocks * block_size; True = visible
    """Clean rows: cache + clean blocks up to their own (block-causal). Candidate rows: cache +
    all clean rows + their own block, never another candidate."""
    q = clean_len + num_blocks * block_size
    row_blk = torch.arange(q) // block_size
    is_clean = torch.arange(q) < clean_len
    vis = torch.zeros(q, cached + q, dtype=torch.bool)
    vis[:, :cached] = True
    same = row_blk[:, None] == row_blk[None, :]
    clean_sees = is_clean[:, None] & is_clean[None, :] & (row_blk[None, :] <= row_blk[:, None])
    cand_sees = (~is_clean[:, None]) & (is_clean[None, :] | same)
    vis[:, cached:] = clean_sees | cand_sees
    return vis


class BlockDiffusionRunner:
    """Holds the committed context's KV cache; every `forward` call is one NFE."""

    def __init__(self, model: Any, spec: DLLMSpec):
        self.model, self.spec = model, spec
        self.device = model.get_input_embeddings().weight.device
        self.cache = DynamicCache(config=model.config)
        self.cached = 0
        self.nfe = 0

    def forward(
        self,
        clean: torch.Tensor,  # [n] ids to commit (n a multiple of block_size, may be 0)
        blocks: torch.Tensor,  # [k, block_size] candidate blocks, all at the same positions
    ) -> torch.Tensor:  # [k, block_size, vocab] fp32 logits of the candidates
        bs = self.spec.block_size
        k = blocks.shape[0]
        n = clean.shape[0]
        ids = torch.cat([clean, blocks.reshape(-1)]).to(self.device)[None]
        start = self.cached + n
        pos = torch.cat([torch.arange(self.cached, start),
                         torch.arange(start, start + bs).repeat(k)]).to(self.device)[None]
        vis = candidate_mask(n, k, bs, self.cached).to(self.device)
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = torch.zeros(vis.shape, dtype=dtype, device=self.device)
        mask = mask.masked_fill(~vis, torch.finfo(dtype).min)[None, None]
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask,
                         past_key_values=self.cache, use_cache=True)
        self.cached += n
        for layer in self.cache.layers:  # candidate K/V are never cached (`crop` semantics
            layer.keys = layer.keys[..., : self.cached, :]  # differ across transformers 5.x)
            layer.values = layer.values[..., : self.cached, :]
        self.nfe += 1
        logits = out.logits[0, n:].float().view(k, bs, -1)
        return ban_tokens(logits, self.spec.banned_token_ids)
