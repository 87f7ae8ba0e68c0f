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
from specdec_kernels.qwen3 import Ops, Rows, decoder_layer, layer_weights
from specdec_kernels.sampling import ban_tokens

from spiffy_plugin.errors import require
from spiffy_plugin.runtime import BlockDiffusionRunner

from .attention import attention_state, merge_states
from .gate import check_delta, check_parents, gate, resolve_sources, source_rows
from .stats import FoldStats

# (h [k, n, d], parents [k], delta) -> fold [k, n] bool; `gate.gate` unless a benchmark forces one
GateFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
FFN_GATES = ("own", "layer")


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
    ops: Ops | None = None,  # the layer's linear / pointwise functions (None: the default)
) -> tuple[torch.Tensor, int, int]:  # layer output [k, n, d], QKV rows, FFN rows
    """`specdec_kernels.qwen3.decoder_layer` with the fold as its gate hook and the merged
    context + own-block attention as its attend hook."""
    k, n, d = h.shape
    scale = layer.self_attn.scaling
    plans: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # site -> (rows [R], take [k*n])

    def fold_rows(x: torch.Tensor, site: str) -> Rows:  # x [k*n, d]
        if site == "ffn" and ffn_gate == "layer":
            plans[site] = plans["attn"]
        else:
            fold = gate_fn(x.view(k, n, d), parents, delta)
            plans[site] = source_rows(resolve_sources(fold, parents), ~fold)
        rows, take = plans[site]
        return Rows(take=lambda t: t[rows], fan=lambda t: t[take])

    def attend(q, kk, v):  # [R, heads | kv_heads, hd] of the recomputed rows
        take = plans["attn"][1]
        heads, hd = q.shape[1], q.shape[2]
        # Context part: once per recomputed row, shared by the rows folded onto it.
        ctx = attention_state(q.transpose(0, 1)[None], keys, values, scale)
        ctx = tuple(t[0].transpose(0, 1)[take].view(k, n, heads, *t.shape[3:]).transpose(1, 2)
                    for t in ctx)  # [k, heads, n, (hd)]
        # Own-block part: every row's (own or inherited) query over its branch's block K/V.
        qb, kb, vb = (t[take].view(k, n, t.shape[1], hd).transpose(1, 2) for t in (q, kk, v))
        out = merge_states(ctx, attention_state(qb, kb, vb, scale))[0]  # [k, heads, n, hd]
        return out.transpose(1, 2).reshape(k * n, heads * hd).to(h.dtype)

    rope = tuple(t[None, :, None].expand(k, n, 1, t.shape[-1]).reshape(k * n, 1, -1)
                 for t in (cos, sin))  # [k*n, 1, hd] per row
    out = decoder_layer(layer_weights(layer), h.reshape(k * n, d), rope, attend, ops, fold_rows)
    return out.view(k, n, d), len(plans["attn"][0]), len(plans["ffn"][0])


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
    ops: Ops | None = None,
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
                                             ffn_gate, gate_fn, ops)
        if stats is not None:
            stats.add_layer(i, qkv_rows, ffn_rows, runner.cached)
    logits = runner.model.lm_head(base.norm(h)).float()
    ban_tokens(logits, runner.spec.banned_token_ids)
    runner.nfe += 1
    return logits
