"""Folded (and dense) Qwen3 verify layers on the `kernels` Triton ops, for many requests at once.

Rows are flat (request, branch, position), T = requests x branches x positions. A *prefix* is the
committed KV cache of every request seen as pages (views, no copy). Per folded layer and gate,
`specdec_kernels.gate.fold_plan`
gates, resolves sources and compacts each request's recomputed rows into
`capacity` slots (a static size; the true `count` stays on the device); QKV / FFN run on the
compact batch and `take_rows` fans results out to every row. Attention of a row = merge of its
source's state over the prefix (computed once per compact row) and its own state over its
branch's block K/V (`specdec_kernels.merge.merge_pair`).
Same math as `fold.folded_layer` (the spec).
Nothing here reads a device value on the host (except with `sync` capacities, None: each gate
sizes its compact batch from its true count), so a forward can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from specdec_kernels.attention import branch_attention
from specdec_kernels.gate import compact, fold_plan, resolve_sources, take_rows
from specdec_kernels.merge import merge_pair

from .fold import _rope


class Prefix(NamedTuple):
    keys: list[torch.Tensor]  # per layer [pages, page_size, kv_heads, hd] (strided views allowed)
    values: list[torch.Tensor]  # per layer [pages, page_size, kv_heads, hd]
    block_table: torch.Tensor  # [requests, max_pages] int32
    lens: torch.Tensor  # [requests] int32 committed tokens of each request


class Batch(NamedTuple):
    ids: torch.Tensor  # [T] long token ids, flat (request, branch, position)
    parent: torch.Tensor  # [requests * branches] int32: parent branch (flat), -1 for each root
    rope: torch.Tensor  # [T, 2 * hd] cos | sin of each row's position
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
            parents: list[int],  # [branches] parent branch of each (the same tree per request)
            context: list[int],  # [requests] committed tokens (the block's first position)
            ) -> Batch:
    """Device inputs of a forward (host -> device copies happen here, outside any graph)."""
    base = model.model
    dev = base.embed_tokens.weight.device
    r, k, n = blocks.shape
    par = torch.tensor(parents, dtype=torch.int32)
    forest = torch.cat([torch.where(par >= 0, par + i * k, par) for i in range(r)])
    pos = (torch.tensor(context)[:, None] + torch.arange(n)[None]).to(dev)  # [r, n]
    h = base.embed_tokens.weight[:1]
    cos, sin = base.rotary_emb(h, pos)  # [r, n, hd]
    rope = torch.cat([cos, sin], -1)[:, None].expand(r, k, n, -1).reshape(r * k * n, -1)
    return Batch(blocks.reshape(-1).to(dev), forest.to(dev), rope.contiguous(), r, k, n)


def _heads(attn) -> tuple[int, int, int]:
    hd = attn.head_dim
    return attn.q_proj.out_features // hd, attn.k_proj.out_features // hd, hd


def _qkv(attn, x: torch.Tensor,  # [M, d] normed layer input
         rope: torch.Tensor,  # [M, 2 * hd]
         ) -> torch.Tensor:  # [M, heads + 2 * kv_heads, hd]: roped q, roped k, v
    heads, kvh, hd = _heads(attn)
    m = x.shape[0]
    cos, sin = rope[:, :hd], rope[:, hd:]
    q = _rope(attn.q_norm(attn.q_proj(x).view(m, heads, hd)), cos, sin)
    k = _rope(attn.k_norm(attn.k_proj(x).view(m, kvh, hd)), cos, sin)
    return torch.cat([q, k, attn.v_proj(x).view(m, kvh, hd)], 1)


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
    attn = layer.self_attn
    heads, kvh, hd = _heads(attn)
    qkv = _qkv(attn, layer.input_layernorm(h), b.rope).view(b.requests, b.branches, b.n, -1, hd)
    q, k, v = qkv.split([heads, kvh, kvh], dim=3)
    out = branch_attention(q, k_blk=k, v_blk=v, scale=attn.scaling, validate=False,
                           **_prefix_args(prefix, i), **_tiles(h))
    mid = h + attn.o_proj(out.view(h.shape[0], heads * hd))
    return mid + layer.mlp(layer.post_attention_layernorm(mid))


def sized_capacity(count: torch.Tensor,  # [requests] true recomputed rows (device)
                   full: int, granule: int = 16) -> int:
    """The `sync` plan of one gate: the largest request's count rounded up to `granule`, at most
    every row (one host read)."""
    need = int(count.max())
    return min(full, max(granule, -(-need // granule) * granule))


def _plan(x: torch.Tensor,  # [T, d] gate input
          b: Batch, delta: float,
          capacity: int | None,  # compact rows per request; None = size from the true count
          forced: torch.Tensor | None,  # [requests * branches, n] bool folds, or None = the gate
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:  # rows, slot, count, cap
    cap = capacity
    if forced is None:
        src, rows, slot, count = fold_plan(x.view(-1, b.n, x.shape[1]), b.parent, delta,
                                           validate=False, segments=b.requests,
                                           capacity=cap)[2:]
    else:
        src = resolve_sources(forced, b.parent)
        rows, slot, count = compact(src, b.requests, cap)
    if capacity is None:  # compacted over every row; re-compact into the sized batch
        full = b.branches * b.n
        cap = sized_capacity(count, full)
        if cap < full:
            rows, slot, count = compact(src, b.requests, cap)
    return rows, slot, count, cap


def folded_layer(layer, i: int, h: torch.Tensor,  # [T, d]
                 b: Batch, prefix: Prefix | None, delta: float,
                 caps: tuple,  # compact rows per request (attention gate, FFN gate); None = sync
                 ffn_gate: str = "own",
                 forced: tuple | None = None,  # (attention folds, FFN folds) [R * k, n] bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> layer output [T, d], recomputed rows per request at the attention / FFN gate [R] each
    (device tensors; a count above its capacity means the output is wrong: re-run wider). A
    capacity of None sizes that gate's compact batch from its true count: a host read per gate,
    so never an overflow, but not capturable in a CUDA graph."""
    attn = layer.self_attn
    heads, kvh, hd = _heads(attn)
    t, r = h.shape[0], b.requests
    rows, slot, count, cap = _plan(h, b, delta, caps[0], forced and forced[0])
    qkv = _qkv(attn, layer.input_layernorm(take_rows(h, rows)), take_rows(b.rope, rows))
    full = take_rows(qkv.view(r * cap, -1), slot).view(r, b.branches, b.n, -1, hd)
    q, k, v = full.split([heads, kvh, kvh], dim=3)
    if prefix is None:
        out = branch_attention(q, k_blk=k, v_blk=v, scale=attn.scaling, validate=False,
                               **_tiles(h))
    else:
        pre = branch_attention(qkv[:, :heads].view(r, 1, cap, heads, hd), scale=attn.scaling,
                               return_state=True, validate=False, out_dtype=torch.float32,
                               **_prefix_args(prefix, i), **_tiles(h))
        blk = branch_attention(q, k_blk=k, v_blk=v, scale=attn.scaling, return_state=True,
                               validate=False, out_dtype=torch.float32, **_tiles(h))
        out = merge_pair(pre[0].view(-1, heads, hd), pre[1].view(-1, heads),
                         pre[2].view(-1, heads), blk[0].view(t, heads, hd),
                         blk[1].view(t, heads), blk[2].view(t, heads), rows_a=slot,
                         dtype=h.dtype)
    mid = h + attn.o_proj(out.view(t, heads * hd))
    if ffn_gate == "layer":
        frows, fslot, fcount = rows, slot, count
    else:
        frows, fslot, fcount, _ = _plan(mid, b, delta, caps[1], forced and forced[1])
    y = layer.mlp(layer.post_attention_layernorm(take_rows(mid, frows)))
    return mid + take_rows(y, fslot), count, fcount


def run_layers(model, h: torch.Tensor,  # [T, d] input of layer `start`
               b: Batch, prefix: Prefix | None, delta: float | None,
               caps: list[tuple[int, int]] | None,  # [layers]; None with delta None (dense)
               ffn_gate: str = "own", start: int = 0,
               forced: list[tuple] | None = None,  # [layers] (attention, FFN) folds
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
                                 forced[i] if forced is not None else None)
        counts.append(torch.stack([ca, cf]))
    return h, inputs, counts


def logits_of(model, h: torch.Tensor,  # [T, d] last layer's output
              ) -> torch.Tensor:  # [T, vocab] fp32
    return model.lm_head(model.model.norm(h)).float()
