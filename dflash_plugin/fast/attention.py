"""Attention backends of the fast runtime over one static cache layer.

*Visible length*: query i of row r sees the cache slots [0, visible[r, i]) of its row. The
target's causal mask (visible = position + 1) and the drafter's block mask (visible = length + q
for every query of the block) both take this form; a forward writes its own K/V before attending.
Backends: "sdpa" (torch SDPA under a boolean mask over all max_len slots) and "triton"
(`specdec_kernels.branch_attention`, which streams only the visible slots: the cache layer [batch,
kv_heads, max_len, dim] is viewed as one page of max_len slots per row, block_table[r] = [r]),
and "triton-invariant", the same kernel under a *batch-invariant* plan: the split-K count, each
split's slot span and the query tile are fixed by the cache size alone, so a query's keys are
reduced in the same order whether it is the one query of a decode step or one of the q queries of
a verify block (see `invariant_splits`).
*Block mask* (tree verification): a block of nb slots starting at the row's prefix length; query
i sees the prefix slots < visible[r] and block slot visible[r] + j iff block_mask[r, i, j]
(sdpa: folded into the boolean mask; triton: the kernel's own `blk_mask` over the forward's new
K/V, with the prefix read from the cache up to visible[r]).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..errors import ConfigError, require

BACKENDS = ("sdpa", "triton", "triton-invariant")
TRITON = ("triton", "triton-invariant")


def resolve_backend(attention: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA when Triton imports (it was faster than SDPA at every shape of
    benchmarks/fast_attention_bench.py on the H200), else "sdpa"; other names pass through."""
    if attention != "auto":
        return attention
    if device.type != "cuda":
        return "sdpa"
    try:
        import specdec_kernels.attention  # noqa: F401
    except ImportError:
        return "sdpa"
    return "triton"


def check_backend(attention: str, device: torch.device) -> None:
    """Fail early on an unknown backend, or "triton" where no Triton kernel can run."""
    require(attention in BACKENDS, "attention", f"must be one of {BACKENDS}, got {attention!r}")
    if attention in TRITON:
        require(device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1", "attention",
                f"{attention!r} needs a CUDA device (or TRITON_INTERPRET=1 on CPU), got {device}")
        try:
            import specdec_kernels.attention  # noqa: F401
        except ImportError as err:
            raise ConfigError("attention",
                              f"{attention!r} needs Triton and `specdec_kernels`: {err}") from None


@dataclass
class AttnPlan:
    """What every layer of one forward shares (built once per forward by `plan`)."""
    backend: str
    mask: torch.Tensor | None = None  # sdpa: [batch, 1, groups * q or 1, max_len] bool
    visible: torch.Tensor | None = None  # triton: [batch, q] int32; None = one length per row
    lengths: torch.Tensor | None = None  # triton: [batch] int32, slots any query of a row sees
    table: torch.Tensor | None = None  # triton: [batch, 1] int32 block table (row r -> page r)
    splits: int | None = None  # triton: split-K (None = the kernel's auto choice)
    split_tokens: int | None = None  # triton: fixed slots per split (None = 1/splits of a row)
    block_m: int | None = None  # triton: query-row tile (None = the kernel's choice from q)
    blk_mask: torch.Tensor | None = None  # triton: [batch, 1, q, nb] bool over the new K/V


def invariant_splits(max_len: int, device: torch.device) -> tuple[int, int, int]:
    """(splits, split_tokens, block_m) of the "triton-invariant" plan, from the cache size and
    device only: about one split per 256 slots (at most 8), spans of whole key tiles covering
    max_len, and the kernel's largest query tile, for every number of queries."""
    bn, bm = (64, 64) if device.type == "cuda" else (16, 16)  # the kernel's defaults
    splits = max(1, min(8, max_len // 256))
    span = -(-max_len // (splits * bn)) * bn
    return splits, span, bm


def group_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[batch, 1, s, L] -> [batch, 1, groups * s, L] to match `attend`'s query rows."""
    if mask.shape[2] == 1 or groups == 1:
        return mask
    b, _, s, n = mask.shape
    return mask[:, :, None].expand(b, 1, groups, s, n).reshape(b, 1, groups * s, n)


def plan(
    backend: str,
    visible: torch.Tensor,  # [batch, q or 1] long: query i sees slots < visible[:, i]
    slots: torch.Tensor,  # [max_len] (`StaticKVCache.slots`)
    groups: int,  # query heads per KV head
    splits: int | None = None,
    block_mask: torch.Tensor | None = None,  # [batch, q, nb] bool; needs visible [batch, 1]
) -> AttnPlan:
    if block_mask is not None:
        return _block_plan(backend, visible, slots, groups, splits, block_mask)
    if backend == "sdpa":
        mask = slots[None, None, None, :] < visible[:, None, :, None]  # [batch, 1, q|1, L]
        return AttnPlan(backend, mask=group_mask(mask, groups))
    vis = visible.to(torch.int32)
    table = torch.arange(vis.shape[0], device=vis.device, dtype=torch.int32)[:, None]
    span = block_m = None
    if backend == "triton-invariant":
        splits, span, block_m = invariant_splits(slots.shape[0], slots.device)
    return AttnPlan(backend, visible=vis.contiguous() if vis.shape[1] > 1 else None,
                    lengths=vis.amax(-1), table=table, splits=splits, split_tokens=span,
                    block_m=block_m)


def _block_plan(backend, visible, slots, groups, splits, block_mask) -> AttnPlan:
    """The plan of a forward whose queries see the prefix < visible[:, 0] plus their own slots
    of a block [visible, visible + nb) under `block_mask` (module docstring)."""
    b, q, nb = block_mask.shape
    require(visible.shape == (b, 1), "visible", f"with a block mask: [batch, 1] prefix lengths, "
            f"got {tuple(visible.shape)}")
    if backend == "sdpa":
        rel = slots[None, :] - visible  # [batch, L] slot offset from the block start
        inside = (rel >= 0) & (rel < nb)
        idx = rel.clamp(0, nb - 1)[:, None, :].expand(b, q, rel.shape[1])
        mask = (rel < 0)[:, None, :] | (block_mask.gather(2, idx) & inside[:, None, :])
        return AttnPlan(backend, mask=group_mask(mask[:, None], groups))  # [batch, 1, q, L]
    lengths = visible[:, 0].to(torch.int32)
    table = torch.arange(b, device=visible.device, dtype=torch.int32)[:, None]
    span = block_m = None
    if backend == "triton-invariant":
        splits, span, block_m = invariant_splits(slots.shape[0], slots.device)
    return AttnPlan(backend, lengths=lengths, table=table, splits=splits, split_tokens=span,
                    block_m=block_m, blk_mask=block_mask[:, None])


def attend(
    p: AttnPlan,
    q: torch.Tensor,  # [batch, heads, s, head_dim]
    k: torch.Tensor,  # [batch, kv_heads, max_len, head_dim] (a static cache layer)
    v: torch.Tensor,
    k_new: torch.Tensor | None = None,  # [batch, s, kv_heads, head_dim]: triton block plans
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:  # [batch, s, heads * head_dim]
    b, h, s, d = q.shape
    if p.backend == "sdpa":  # GQA without copying the cache: a group's heads become query rows
        g = h // k.shape[1]
        qg = q.reshape(b, k.shape[1], g * s, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=p.mask, scale=d ** -0.5)
        return out.reshape(b, h, s, d).transpose(1, 2).reshape(b, s, h * d)
    from specdec_kernels.attention import branch_attention

    qs = q.transpose(1, 2)  # [batch, s, heads, d] (a view)
    if p.blk_mask is not None:  # the prefix from the cache, the block from the new K/V
        out = branch_attention(qs[:, None], k.transpose(1, 2), v.transpose(1, 2), p.table,
                               p.lengths, k_blk=k_new[:, None], v_blk=v_new[:, None],
                               blk_mask=p.blk_mask, scale=d ** -0.5, validate=False,
                               num_splits=p.splits, split_tokens=p.split_tokens,
                               block_m=p.block_m)
        return out.reshape(b, s, h * d)
    # per-query lengths: each query is a branch of length 1; else one branch of s queries
    q5 = qs[:, :, None] if p.visible is not None else qs[:, None]
    out = branch_attention(q5, k.transpose(1, 2), v.transpose(1, 2), p.table, p.lengths,
                           prefix_visible=p.visible, scale=d ** -0.5, validate=False,
                           num_splits=p.splits, split_tokens=p.split_tokens, block_m=p.block_m)
    return out.reshape(b, s, h * d)
