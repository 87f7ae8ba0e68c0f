"""SpecFold's folded verify forward of a Qwen3 block-diffusion model over a Spiffy branch batch.

Per layer, over the branches' residual streams h [k, block, d] (each branch keeps its own):
- *attention gate* on the layer input h: only recomputed rows run input norm + Q/K/V; a folded
  row takes its source's Q/K/V (`gate.resolve_sources`). Attention of every row = merge of (its
  source's attention state over the committed KV cache, computed once per recomputed row: a
  folded row has its source's query, so that part is identical) and (its query over its OWN
  branch's block K/V, a mix of recomputed and inherited rows). So attention is exact w.r.t. the
  branch's own K/V. o_proj and the residual add run on every row.
- *FFN gate* on the FFN input (the residual after attention), same delta: only recomputed rows
  run norm + FFN; a folded row adds its source's FFN output. Gating the FFN on its own input keeps
  delta = 0 exact (a row with an identical layer input still sees different block keys, so its
  FFN input differs); `ffn_gate="layer"` instead reuses the attention gate's set (the issue's
  literal rule: one folded set per layer; not exact at delta = 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spiffy_plugin.errors import require
from spiffy_plugin.runtime import BlockDiffusionRunner

from .attention import attention_state, merge_states
from .gate import check_delta, check_parents, gate, resolve_sources, source_rows
from .stats import FoldStats

# (h [k, n, d], parents [k], delta) -> fold [k, n] bool; `gate.gate` unless a benchmark forces one
GateFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
FFN_GATES = ("own", "layer")


def _rope(x: torch.Tensor,  # [r, heads, hd]
          cos: torch.Tensor, sin: torch.Tensor,  # [r, hd]
          ) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


def _cache_kv(runner: BlockDiffusionRunner, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Committed K/V of one layer: [1, kv_heads, cached, hd] each."""
    entry = runner.cache.layers[layer]
    return entry.keys[..., : runner.cached, :], entry.values[..., : runner.cached, :]


def folded_layer(
    layer,  # a Qwen3DecoderLayer
    h: torch.Tensor,  # [k, n, d] residual stream entering the layer, per branch
    parents: torch.Tensor,  # [k] long
    keys: torch.Tensor,  # [1, kv_heads, cached, hd] committed context
    values: torch.Tensor,  # [1, kv_heads, cached, hd]
    cos: torch.Tensor, sin: torch.Tensor,  # [n, hd] rotary tables of the block positions
    delta: float,
    ffn_gate: str = "own",
    gate_fn: GateFn = gate,
) -> tuple[torch.Tensor, int, int]:  # layer output [k, n, d], QKV rows, FFN rows
    attn = layer.self_attn
    k, n, d = h.shape
    hd = attn.head_dim
    flat = h.reshape(k * n, d)
    fold = gate_fn(h, parents, delta)
    rows, take = source_rows(resolve_sources(fold, parents), ~fold)  # [R], [k*n]
    x = layer.input_layernorm(flat[rows])  # [R, d]
    pos = rows % n
    q = _rope(attn.q_norm(attn.q_proj(x).view(len(rows), -1, hd)), cos[pos], sin[pos])
    kk = _rope(attn.k_norm(attn.k_proj(x).view(len(rows), -1, hd)), cos[pos], sin[pos])
    v = attn.v_proj(x).view(len(rows), -1, hd)
    heads = q.shape[1]
    # Context part: once per recomputed row, shared by the rows folded onto it.
    ctx = attention_state(q.transpose(0, 1)[None], keys, values, attn.scaling)
    ctx = tuple(t[0].transpose(0, 1)[take].view(k, n, heads, *t.shape[3:]).transpose(1, 2)
                for t in ctx)  # [k, heads, n, (hd)]
    # Own-block part: every row's (own or inherited) query over its branch's block K/V.
    qb, kb, vb = (t[take].view(k, n, t.shape[1], hd).transpose(1, 2) for t in (q, kk, v))
    out = merge_states(ctx, attention_state(qb, kb, vb, attn.scaling))[0]  # [k, heads, n, hd]
    out = out.transpose(1, 2).reshape(k * n, heads * hd).to(h.dtype)
    mid = flat + attn.o_proj(out)  # [k*n, d]
    if ffn_gate == "layer":
        frows, ftake = rows, take
    else:
        ffold = gate_fn(mid.view(k, n, d), parents, delta)
        frows, ftake = source_rows(resolve_sources(ffold, parents), ~ffold)
    y = layer.mlp(layer.post_attention_layernorm(mid[frows]))  # [R_ffn, d]
    return (mid + y[ftake]).view(k, n, d), len(rows), len(frows)


def check_fold_args(blocks: torch.Tensor,  # [k, block_size]
                    parents: list[int], delta: float, ffn_gate: str) -> float:
    """The checks every folded forward makes; returns delta as a float."""
    delta = check_delta(delta)
    check_parents(parents)
    require(ffn_gate in FFN_GATES, "ffn_gate", f"must be one of {FFN_GATES}, got {ffn_gate!r}")
    k = blocks.shape[0]
    require(len(parents) == k, "parents", f"needs one entry per block ({k}), got {len(parents)}")
    return delta


@torch.inference_mode()
def folded_forward(
    runner: BlockDiffusionRunner,
    blocks: torch.Tensor,  # [k, block_size] ids: branch 0 = the root, then the drafts
    parents: list[int],  # [k] parent branch of each, parents[0] = -1
    delta: float,
    stats: FoldStats | None = None,
    ffn_gate: str = "own",
    gate_fn: GateFn = gate,
) -> torch.Tensor:  # [k, block_size, vocab] fp32 logits (one NFE)
    """Score the branches like `runner.forward(empty, blocks)` with folding; caches nothing."""
    delta = check_fold_args(blocks, parents, delta, ffn_gate)
    k, n = blocks.shape
    require(n == runner.spec.block_size, "blocks", f"blocks of {runner.spec.block_size} tokens "
            f"expected, got {n}")
    base = runner.model.model
    dev = runner.device
    par = torch.tensor(parents, dtype=torch.long, device=dev)
    h = base.embed_tokens(blocks.to(dev))  # [k, n, d]
    pos = runner.cached + torch.arange(n, device=dev)
    cos, sin = base.rotary_emb(h, pos[None])
    cos, sin = cos[0], sin[0]  # [n, hd]
    if stats is not None:
        stats.add_forward(k * n, n, runner.cached)
    for i, layer in enumerate(base.layers):
        keys, values = _cache_kv(runner, i)
        h, qkv_rows, ffn_rows = folded_layer(layer, h, par, keys, values, cos, sin, delta,
                                             ffn_gate, gate_fn)
        if stats is not None:
            stats.add_layer(i, qkv_rows, ffn_rows, runner.cached)
    logits = runner.model.lm_head(base.norm(h)).float()
    if runner.spec.banned_token_ids:
        logits[..., list(runner.spec.banned_token_ids)] = float("-inf")
    runner.nfe += 1
    return logits
