"""Folded (and dense) Qwen3 verify layers on the `kernels` Triton ops, for many requests at once.

Rows are flat (request, branch, position), T = requests x branches x positions. A *prefix* is the
committed KV cache of every request seen as pages (views, no copy). Per folded layer and gate,
`specdec_kernels.gate.fold_plan` gates, resolves sources and compacts each request's recomputed
rows into `capacity` slots (a static size; the true `count` stays on the device); QKV / FFN run
on the compact batch and `take_rows` fans results out to every row. Attention of a row = merge of
its source's state over the prefix (computed once per compact row) and its own state over its
branch's block K/V (`specdec_kernels.merge.merge_pair`). *Shared* (batch-wide) compaction packs
the recomputed rows of ALL requests into one batch of `capacity` rows (`gate.compact_batch`, a
row -> request map); its prefix attention is ragged (`packed_attention.packed_attention`: each
packed row reads its own request's pages). Same results, other capacity semantics: per request
(rows in [1, branches x n]) or for the batch (rows in [1, requests x branches x n]).
Each layer is `specdec_kernels.qwen3.decoder_layer` (gate + attend hooks); same math as
`fold.folded_layer` (the spec).
Nothing here reads a device value on the host (except with `sync` capacities, None: each gate
sizes its compact batch from its true count), so a forward can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from specdec_kernels.attention import branch_attention
from specdec_kernels.gate import (
    compact,
    compact_batch,
    fold_plan,
    gate,
    resolve_sources,
    take_rows,
)
from specdec_kernels.merge import merge_pair
from specdec_kernels.packed_attention import packed_attention
from specdec_kernels.qwen3 import Rows, decoder_layer, layer_weights


class Prefix(NamedTuple):
    keys: list[torch.Tensor]  # per layer [pages, page_size, kv_heads, hd] (strided views allowed)
    values: list[torch.Tensor]  # per layer [pages, page_size, kv_heads, hd]
    block_table: torch.Tensor  # [requests, max_pages] int32
    lens: torch.Tensor  # [requests] int32 committed tokens of each request


class Batch(NamedTuple):
    ids: torch.Tensor  # [T] long token ids, flat (request, branch, position)
    parent: torch.Tensor  # [requests * branches] int32: parent branch (flat), -1 for each root
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, hd] of each row's position
    requests: int
    branches: int
    n: int  # positions per block


def cache_pages(t: torch.Tensor,  # [1, kv_heads, >= cached, hd] one layer of a DynamicCache
                cached: int, page_size: int) -> torch.Tensor:  # [pages, page_size, kv_heads, hd]
    """The first `cached` tokens as pages: a strided view of the same memory (no copy)."""
    return t[0, :, :cached].unflatten(1, (cached // page_size, page_size)).permute(1, 2, 0, 3)


def runner_prefix(runner) -> Prefix | None:
    """The runner's committed cache as one request's paged prefix (None when empty)."""
    cached = runner.cached
    if cached == 0:
        return None
    ps = runner.spec.block_size if cached % runner.spec.block_size == 0 else 1
    layers = runner.cache.layers
    dev = runner.device
    return Prefix([cache_pages(e.keys, cached, ps) for e in layers],
                  [cache_pages(e.values, cached, ps) for e in layers],
                  torch.arange(cached // ps, dtype=torch.int32, device=dev)[None],
                  torch.full((1,), cached, dtype=torch.int32, device=dev))


def prepare(model, blocks: torch.Tensor,  # [requests, branches, n] ids
            parents: list[int] | list[list[int]],  # [branches] parent branch of each: one
            # tree for every request, or [requests][branches] one tree per request
            context: list[int],  # [requests] committed tokens (the block's first position)
            ) -> Batch:
    """Device inputs of a forward (host -> device copies happen here, outside any graph)."""
    base = model.model
    dev = base.embed_tokens.weight.device
    r, k, n = blocks.shape
    trees = parents if parents and isinstance(parents[0], (list, tuple)) else [parents] * r
    par = torch.tensor(trees, dtype=torch.int32).view(r, k)
    forest = torch.cat([torch.where(par[i] >= 0, par[i] + i * k, par[i]) for i in range(r)])
    pos = (torch.tensor(context)[:, None] + torch.arange(n)[None]).to(dev)  # [r, n]
    h = base.embed_tokens.weight[:1]
    cos, sin = base.rotary_emb(h, pos)  # [r, n, hd]
    rope = tuple(t[:, None].expand(r, k, n, -1).reshape(r * k * n, 1, -1).contiguous()
                 for t in (cos, sin))
    return Batch(blocks.reshape(-1).to(dev), forest.to(dev), rope, r, k, n)


def _take(x: torch.Tensor,  # [M, ...] contiguous
          idx: torch.Tensor,  # [T] int32 (-1 = zero row)
          ) -> torch.Tensor:  # [T, ...]
    return take_rows(x.reshape(x.shape[0], -1), idx).view(-1, *x.shape[1:])


def _prefix_args(prefix: Prefix | None, layer: int) -> dict:
    if prefix is None:
        return {}
    return dict(k_cache=prefix.keys[layer], v_cache=prefix.values[layer],
                block_table=prefix.block_table, prefix_lens=prefix.lens)


def _tiles(x: torch.Tensor) -> dict:
    """Attention tiles: the kernel's choice on a GPU; large ones in the CPU interpreter (which
    runs programs one after another)."""
    return {} if x.device.type == "cuda" else dict(block_m=128, block_n=64)


def dense_layer(layer, i: int, h: torch.Tensor,  # [T, d]
                b: Batch, prefix: Prefix | None) -> torch.Tensor:  # [T, d]
    """Every row recomputed: one attention launch over prefix + own block (the dense baseline
    on the same kernels)."""
    w = layer_weights(layer)
    scale = layer.self_attn.scaling

    def attend(q, k, v):  # [T, heads | kv_heads, hd]
        qkv = torch.cat([q, k, v], 1).view(b.requests, b.branches, b.n, -1, w.head_dim)
        q, k, v = qkv.split([w.heads, w.kv_heads, w.kv_heads], dim=3)  # one layout for all
        out = branch_attention(q, k_blk=k, v_blk=v, scale=scale, validate=False,
                               **_prefix_args(prefix, i), **_tiles(h))
        return out.view(h.shape[0], -1)
    return decoder_layer(w, h, b.rope, attend)


def sized_capacity(count: torch.Tensor,  # [requests] true recomputed rows (device)
                   full: int, granule: int = 16, shared: bool = False) -> int:
    """The `sync` plan of one gate: the largest request's count (shared: the batch's sum)
    rounded up to `granule`, at most every row (`full`; one host read)."""
    need = int(count.sum() if shared else count.max())
    return min(full, max(granule, -(-need // granule) * granule))


def _compact(src: torch.Tensor, b: Batch, cap: int | None, shared: bool) -> tuple:
    """-> rows, slot, count [requests], row_request (shared) or None."""
    if shared:
        return compact_batch(src, b.requests, b.requests * b.branches * b.n if cap is None
                             else cap)
    return (*compact(src, b.requests, cap), None)


def _plan(x: torch.Tensor,  # [T, d] gate input
          b: Batch, delta: float,
          capacity: int | None,  # compact rows (per request or shared); None = from the count
          forced: torch.Tensor | None,  # [requests * branches, n] bool folds, or None = the gate
          shared: bool = False,  # one compact batch for all requests (capacity = its rows)
          ) -> tuple:  # rows, slot, count [requests], cap, row_request (shared) or None
    cap = capacity
    if forced is None and not shared:
        src, rows, slot, count = fold_plan(x.view(-1, b.n, x.shape[1]), b.parent, delta,
                                           validate=False, segments=b.requests,
                                           capacity=cap)[2:]
        req = None
    else:
        if forced is None:
            forced = gate(x.view(-1, b.n, x.shape[1]), b.parent, delta, validate=False)[1]
        src = resolve_sources(forced, b.parent)
        rows, slot, count, req = _compact(src, b, cap, shared)
    if capacity is None:  # compacted over every row; re-compact into the sized batch
        full = b.branches * b.n * (b.requests if shared else 1)
        cap = sized_capacity(count, full, shared=shared)
        if cap < full:
            rows, slot, count, req = _compact(src, b, cap, shared)
    return rows, slot, count, cap, req


def folded_layer(layer, i: int, h: torch.Tensor,  # [T, d]
                 b: Batch, prefix: Prefix | None, delta: float,
                 caps: tuple,  # compact rows per request (attention gate, FFN gate); None = sync
                 ffn_gate: str = "own",
                 forced: tuple | None = None,  # (attention folds, FFN folds) [R * k, n] bool
                 shared: bool = False,  # one compact batch for all requests (caps: its rows)
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> layer output [T, d], recomputed rows per request at the attention / FFN gate [R] each
    (device tensors; a count above its capacity, or with `shared` a sum above it, means the
    output is wrong: re-run wider). A capacity of None sizes that gate's compact batch from its
    true count: a host read per gate, so never an overflow, but not capturable in a CUDA graph.
    The layer is `specdec_kernels.qwen3.decoder_layer` with the fold plan as its gate hook."""
    w = layer_weights(layer)
    scale = layer.self_attn.scaling
    heads, hd = w.heads, w.head_dim
    t, r = h.shape[0], b.requests
    plans: dict[str, tuple] = {}  # site -> (rows, slot, count, cap)

    def fold_rows(x: torch.Tensor, site: str) -> Rows:  # x [T, d]
        j = 0 if site == "attn" else 1
        if j and ffn_gate == "layer":
            plans[site] = plans["attn"]
        else:
            plans[site] = _plan(x, b, delta, caps[j], forced and forced[j], shared)
        rows, slot = plans[site][:2]
        return Rows(take=lambda y: _take(y, rows), fan=lambda y: _take(y, slot))

    def attend(q, k, v):  # [M, heads | kv_heads, hd] compact rows (M = R * cap, or cap)
        _, slot, _, cap, req = plans["attn"]
        qkv = torch.cat([q, k, v], 1)  # [M, heads + 2 * kv_heads, hd]
        full = take_rows(qkv.view(qkv.shape[0], -1), slot).view(r, b.branches, b.n, -1, hd)
        qf, kf, vf = full.split([heads, w.kv_heads, w.kv_heads], dim=3)
        if prefix is None:
            return branch_attention(qf, k_blk=kf, v_blk=vf, scale=scale, validate=False,
                                    **_tiles(h)).view(t, heads * hd)
        if shared:  # ragged: each packed row reads its own request's pages
            pre = packed_attention(qkv[:, :heads], req, prefix.keys[i], prefix.values[i],
                                   prefix.block_table, prefix.lens, scale=scale,
                                   validate=False, **_tiles(h))
        else:
            pre = branch_attention(qkv[:, :heads].view(r, 1, cap, heads, hd), scale=scale,
                                   return_state=True, validate=False, out_dtype=torch.float32,
                                   **_prefix_args(prefix, i), **_tiles(h))
        blk = branch_attention(qf, k_blk=kf, v_blk=vf, scale=scale, return_state=True,
                               validate=False, out_dtype=torch.float32, **_tiles(h))
        out = merge_pair(pre[0].view(-1, heads, hd), pre[1].view(-1, heads),
                         pre[2].view(-1, heads), blk[0].view(t, heads, hd),
                         blk[1].view(t, heads), blk[2].view(t, heads), rows_a=slot,
                         dtype=h.dtype)
        return out.view(t, heads * hd)

    out = decoder_layer(w, h, b.rope, attend, gate=fold_rows)
    return out, plans["attn"][2], plans["ffn"][2]


def run_layers(model, h: torch.Tensor,  # [T, d] input of layer `start`
               b: Batch, prefix: Prefix | None, delta: float | None,
               caps: list[tuple[int, int]] | None,  # [layers]; None with delta None (dense)
               ffn_gate: str = "own", start: int = 0,
               forced: list[tuple] | None = None,  # [layers] (attention, FFN) folds
               shared: bool = False,  # batch-wide compaction (caps: rows of the whole batch)
               ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Layers start.. -> (last hidden [T, d], each layer's input [T, d], counts [2, R] each).
    delta None = dense layers (no gate, no counts)."""
    inputs, counts = [], []
    for i, layer in enumerate(model.model.layers[start:], start):
        inputs.append(h)
        if delta is None:
            h = dense_layer(layer, i, h, b, prefix)
            continue
        h, ca, cf = folded_layer(layer, i, h, b, prefix, delta, caps[i], ffn_gate,
                                 forced[i] if forced is not None else None, shared)
        counts.append(torch.stack([ca, cf]))
    return h, inputs, counts


def logits_of(model, h: torch.Tensor,  # [T, d] last layer's output
              ) -> torch.Tensor:  # [T, vocab] fp32
    return model.lm_head(model.model.norm(h)).float()
