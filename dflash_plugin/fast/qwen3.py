"""A plain Qwen3 forward over static caches, for the fast runtime (gpt-fast style).

Each layer is `specdec_kernels.qwen3.decoder_layer` with `cache_attend` as its attention hook:
it writes the layer's new K/V at the tokens' positions, then attends over the static cache
(`attention.py`: SDPA or the Triton kernel, under a visible length per query). *Features* are the
outputs of the decoder layers in `feature_layers` (HF `hidden_states[id + 1]`; the last layer's
after the final norm, as HF reports it). Weights: the HF module's own, fused once in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specdec_kernels.qwen3 import LayerWeights, Ops, compile_pointwise, decoder_layer, rms_norm
from specdec_kernels.qwen3 import layer_weights as module_layer_weights
from torch.nn import functional as F

from ..errors import require
from .attention import AttnPlan, attend, plan
from .cache import StaticKVCache

__all__ = ["LayerWeights", "Shape", "TargetWeights", "cache_attend", "compile_pointwise",
           "random_target", "rope_at", "supports", "target_forward", "target_weights"]


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float = 1e-6
    theta: float = 1_000_000.0


@dataclass
class TargetWeights:
    shape: Shape
    embed: torch.Tensor  # [vocab, hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the same tensor when tied)
    norm: torch.Tensor  # [hidden]
    layers: list[LayerWeights]


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    require(kind == "default", "rope_parameters.rope_type",
            f"the fast runtime supports default RoPE only, got {kind!r}")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def supports(model) -> bool:
    """True for a bias-free Qwen3 causal LM with default RoPE (what `target_weights` reads)."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) != "qwen3" or getattr(cfg, "attention_bias", True):
        return False
    try:
        _rope_theta(cfg)
    except ValueError:
        return False
    return not any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or []))


def target_weights(model, dtype: torch.dtype | None = None) -> TargetWeights:
    """A Hugging Face Qwen3ForCausalLM's weights, fused once (`layer_weights`): in its dtype the
    module's parameters become views of the fused tensors, so the model is held once; another
    `dtype` makes a converted copy."""
    require(supports(model), "target", "the fast runtime needs a bias-free Qwen3 with full "
            "attention and default RoPE")
    cfg = model.config
    emb = model.get_input_embeddings().weight
    dtype = dtype or emb.dtype
    shape = Shape(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                  cfg.num_key_value_heads, getattr(cfg, "head_dim", None)
                  or cfg.hidden_size // cfg.num_attention_heads, cfg.intermediate_size,
                  cfg.vocab_size, cfg.rms_norm_eps, _rope_theta(cfg))
    layers = [module_layer_weights(m, dtype) for m in model.model.layers]
    head = model.get_output_embeddings().weight
    embed = emb.detach().to(dtype)
    lm_head = embed if head is emb else head.detach().to(dtype)
    return TargetWeights(shape, embed, lm_head, model.model.norm.weight.detach().to(dtype), layers)


def random_layer(s: Shape, dtype, device, gen: torch.Generator | None = None) -> LayerWeights:
    def r(*size):
        return (torch.randn(*size, generator=gen, device=device) * 0.02).to(dtype)
    hd = s.head_dim
    ones = torch.ones(s.hidden, dtype=dtype, device=device)
    return LayerWeights(ones, ones.clone(), r((s.heads + 2 * s.kv_heads) * hd, s.hidden),
                        r(s.hidden, s.heads * hd),
                        torch.ones(s.heads + s.kv_heads, hd, dtype=dtype, device=device),
                        r(2 * s.intermediate, s.hidden), r(s.hidden, s.intermediate),
                        s.heads, s.kv_heads, s.eps)


def random_target(s: Shape, dtype, device, seed: int = 0) -> TargetWeights:
    """Random weights at a given shape (timing only: the 8B-shape projection)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    embed = (torch.randn(s.vocab, s.hidden, generator=gen, device=device) * 0.02).to(dtype)
    head = (torch.randn(s.vocab, s.hidden, generator=gen, device=device) * 0.02).to(dtype)
    return TargetWeights(s, embed, head, torch.ones(s.hidden, dtype=dtype, device=device),
                         [random_layer(s, dtype, device, gen) for _ in range(s.layers)])


def rope_at(rope_tab, positions: torch.Tensor):  # positions [batch, q]
    """cos, sin [batch, q, 1, head_dim] (broadcast over heads in [batch, q, heads, d])."""
    return rope_tab[0][positions][:, :, None], rope_tab[1][positions][:, :, None]


def cache_attend(
    cache: StaticKVCache,
    layer: int,
    slots: torch.Tensor,  # [batch, q] long: where the new K/V go (their positions, or a tree's
    #                       scratch slots)
    attn: AttnPlan,  # the forward's attention inputs (`attention.plan`)
):
    """The fast runtime's `attend` hook: store the new K/V at `slots`, then `attend` over the
    static cache layer (a plan with a block mask reads the new K/V themselves for the block)."""
    def hook(q, k, v):  # [batch, q, heads | kv_heads, head_dim]
        cache.write(layer, k.transpose(1, 2), v.transpose(1, 2), slots)
        return attend(attn, q.transpose(1, 2), cache.k[layer], cache.v[layer], k, v)
    return hook


def target_forward(
    w: TargetWeights,
    cache: StaticKVCache,
    rope_tab: tuple[torch.Tensor, torch.Tensor],  # cos, sin [max_len, head_dim]
    ids: torch.Tensor,  # [batch, q]
    positions: torch.Tensor,  # [batch, q] long
    visible: torch.Tensor | None,  # [batch, q] long: query i sees slots < visible[:, i]
    #                                (positions + 1); None with `attn`
    feature_layers: tuple[int, ...] = (),
    attention: str = "sdpa",  # `attention.BACKENDS`
    ops: Ops | None = None,  # None: `specdec_kernels.qwen3.default_ops()`
    slots: torch.Tensor | None = None,  # [batch, q] long: K/V slots (None: `positions`)
    attn: AttnPlan | None = None,  # a prebuilt plan (a tree's block mask) instead of `visible`
) -> tuple[torch.Tensor, torch.Tensor | None]:  # final-normed hidden [batch, q, hidden], feats
    """One forward over q new tokens per row; their K/V land in `cache` at `slots` (default
    their positions; a tree block uses scratch slots and a block-mask plan)."""
    s = w.shape
    rope = rope_at(rope_tab, positions)
    if attn is None:
        attn = plan(attention, visible, cache.slots, s.heads // s.kv_heads)
    slots = positions if slots is None else slots
    h = F.embedding(ids, w.embed)
    picked: dict[int, torch.Tensor] = {}
    for i, lw in enumerate(w.layers):
        h = decoder_layer(lw, h, rope, cache_attend(cache, i, slots, attn), ops)
        if i in feature_layers:
            picked[i] = h
    hn = (ops.rms_norm if ops is not None else rms_norm)(h, w.norm, s.eps)  # ops: invariant
    if s.layers - 1 in picked:
        picked[s.layers - 1] = hn
    feats = torch.cat([picked[i] for i in feature_layers], -1) if feature_layers else None
    return hn, feats
