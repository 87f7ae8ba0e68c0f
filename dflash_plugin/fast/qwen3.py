"""A plain Qwen3 forward over static caches, for the fast runtime (gpt-fast style).

Weights are pulled from a Hugging Face Qwen3 module (or made random at a given shape) into fused
matrices: one QKV and one gate/up matmul per layer. `layer_forward` writes the layer's new K/V at
the tokens' positions, then attends over the static cache (`attention.py`: SDPA or the Triton
kernel, under a visible length per query). *Features* are the outputs of the decoder layers in
`feature_layers` (HF `hidden_states[id + 1]`: the last layer's is taken after the final norm, as
HF reports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..errors import require
from ..layers import rms_norm
from .attention import AttnPlan, attend, plan
from .cache import StaticKVCache


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
class LayerWeights:
    ln1: torch.Tensor  # [hidden]
    ln2: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    wo: torch.Tensor  # [hidden, heads * head_dim]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    qk_norm: torch.Tensor  # [heads + kv_heads, head_dim]: q_norm per q head, then k_norm
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]
    w_down: torch.Tensor  # [hidden, intermediate]


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


def layer_weights(attn, mlp, ln1, ln2, dtype) -> LayerWeights:
    """Fused weights of one Qwen3 decoder layer (HF `Qwen3DecoderLayer` or our `DraftLayer`)."""
    def w(t):
        return t.detach().to(dtype)
    qn, kn = w(attn.q_norm.weight), w(attn.k_norm.weight)
    heads = attn.q_proj.weight.shape[0] // qn.shape[0]
    kv_heads = attn.k_proj.weight.shape[0] // kn.shape[0]
    return LayerWeights(
        ln1=w(ln1.weight), ln2=w(ln2.weight),
        wqkv=w(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
        wo=w(attn.o_proj.weight), q_norm=qn, k_norm=kn, qk_norm=_qk_norm(qn, kn, heads, kv_heads),
        w_gate_up=w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
        w_down=w(mlp.down_proj.weight))


def _qk_norm(qn, kn, heads, kv_heads) -> torch.Tensor:  # [heads + kv_heads, head_dim]
    return torch.cat([qn[None].expand(heads, -1), kn[None].expand(kv_heads, -1)]).contiguous()


def target_weights(model, dtype: torch.dtype | None = None) -> TargetWeights:
    """Read a Hugging Face Qwen3ForCausalLM (the weights are copied once, into fused form)."""
    require(supports(model), "target", "the fast runtime needs a bias-free Qwen3 with full "
            "attention and default RoPE")
    cfg = model.config
    emb = model.get_input_embeddings().weight
    dtype = dtype or emb.dtype
    shape = Shape(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                  cfg.num_key_value_heads, getattr(cfg, "head_dim", None)
                  or cfg.hidden_size // cfg.num_attention_heads, cfg.intermediate_size,
                  cfg.vocab_size, cfg.rms_norm_eps, _rope_theta(cfg))
    layers = [layer_weights(m.self_attn, m.mlp, m.input_layernorm, m.post_attention_layernorm,
                            dtype) for m in model.model.layers]
    head = model.get_output_embeddings().weight
    embed = emb.detach().to(dtype)
    lm_head = embed if head is emb else head.detach().to(dtype)
    return TargetWeights(shape, embed, lm_head, model.model.norm.weight.detach().to(dtype), layers)


def random_layer(s: Shape, dtype, device, gen: torch.Generator | None = None) -> LayerWeights:
    def r(*size):
        return (torch.randn(*size, generator=gen, device=device) * 0.02).to(dtype)
    hd = s.head_dim
    ones = torch.ones(s.hidden, dtype=dtype, device=device)
    qn, kn = (torch.ones(hd, dtype=dtype, device=device) for _ in range(2))
    return LayerWeights(ones, ones.clone(), r((s.heads + 2 * s.kv_heads) * hd, s.hidden),
                        r(s.hidden, s.heads * hd), qn, kn, _qk_norm(qn, kn, s.heads, s.kv_heads),
                        r(2 * s.intermediate, s.hidden), r(s.hidden, s.intermediate))


def random_target(s: Shape, dtype, device, seed: int = 0) -> TargetWeights:
    """Random weights at a given shape (timing only: the 8B-shape projection)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    embed = (torch.randn(s.vocab, s.hidden, generator=gen, device=device) * 0.02).to(dtype)
    head = (torch.randn(s.vocab, s.hidden, generator=gen, device=device) * 0.02).to(dtype)
    return TargetWeights(s, embed, head, torch.ones(s.hidden, dtype=dtype, device=device),
                         [random_layer(s, dtype, device, gen) for _ in range(s.layers)])


def apply_rope(
    x: torch.Tensor,  # [..., head_dim]
    cos: torch.Tensor,  # broadcastable to x
    sin_signed: torch.Tensor,  # sin with its first half negated (`cache.rope_table`)
) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit-exact: roll swaps the halves, the sign is in sin."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin_signed


def norm_rope(x, weight, eps, cos, sin_signed):  # [batch, q, heads, head_dim]
    return apply_rope(rms_norm(x, weight, eps), cos, sin_signed)


def add_norm(h, delta, weight, eps):  # [batch, q, hidden] twice
    """(h + delta, rms_norm(h + delta)): the residual add and the next norm."""
    h = h + delta
    return h, rms_norm(h, weight, eps)


def swiglu(gate_up):  # [batch, q, 2 * intermediate] -> [batch, q, intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


POINTWISE = {"rms_norm": rms_norm, "norm_rope": norm_rope, "add_norm": add_norm,
             "swiglu": swiglu}
_ops = dict(POINTWISE)  # what layer_forward calls


def compile_pointwise(enabled: bool = True) -> None:
    """Opt-in: run the elementwise pieces through `torch.compile` (one fused kernel each instead
    of ~4-8; same math, reduction order may differ in the last bit). Compiles lazily on first
    use, i.e. in a graph's eager warm-up, never during capture. `False` restores eager."""
    for name, fn in POINTWISE.items():
        _ops[name] = torch.compile(fn, dynamic=True) if enabled else fn


def rope_at(rope_tab, positions: torch.Tensor):  # positions [batch, q]
    """cos, sin_signed [batch, q, 1, head_dim] (broadcast over heads in [batch, q, heads, d])."""
    return rope_tab[0][positions][:, :, None], rope_tab[1][positions][:, :, None]


def layer_forward(
    lw: LayerWeights,
    s: Shape,
    h: torch.Tensor,  # [batch, q, hidden]
    rope: tuple[torch.Tensor, torch.Tensor],  # `rope_at`: [batch, q, 1, head_dim] each
    cache: StaticKVCache,
    layer: int,
    positions: torch.Tensor,  # [batch, q] long
    attn: AttnPlan,  # the forward's attention inputs (`attention.plan`)
) -> torch.Tensor:  # [batch, q, hidden]
    b, n, _ = h.shape
    qkv = F.linear(_ops["rms_norm"](h, lw.ln1, s.eps), lw.wqkv).view(b, n, -1, s.head_dim)
    qk = _ops["norm_rope"](qkv[:, :, :s.heads + s.kv_heads], lw.qk_norm, s.eps, *rope)
    q = qk[:, :, :s.heads].transpose(1, 2)
    k = qk[:, :, s.heads:].transpose(1, 2)
    cache.write(layer, k, qkv[:, :, s.heads + s.kv_heads:].transpose(1, 2), positions)
    h, x = _ops["add_norm"](h, F.linear(attend(attn, q, cache.k[layer], cache.v[layer]), lw.wo),
                            lw.ln2, s.eps)
    return h + F.linear(_ops["swiglu"](F.linear(x, lw.w_gate_up)), lw.w_down)


def target_forward(
    w: TargetWeights,
    cache: StaticKVCache,
    rope_tab: tuple[torch.Tensor, torch.Tensor],  # cos, sin [max_len, head_dim]
    ids: torch.Tensor,  # [batch, q]
    positions: torch.Tensor,  # [batch, q] long
    visible: torch.Tensor,  # [batch, q] long: query i sees slots < visible[:, i] (positions + 1)
    feature_layers: tuple[int, ...] = (),
    attention: str = "sdpa",  # `attention.BACKENDS`
) -> tuple[torch.Tensor, torch.Tensor | None]:  # final-normed hidden [batch, q, hidden], feats
    """One forward over q new tokens per row; their K/V land in `cache` at `positions`."""
    s = w.shape
    rope = rope_at(rope_tab, positions)
    attn = plan(attention, visible, cache.slots, s.heads // s.kv_heads)
    h = F.embedding(ids, w.embed)
    picked: dict[int, torch.Tensor] = {}
    for i, lw in enumerate(w.layers):
        h = layer_forward(lw, s, h, rope, cache, i, positions, attn)
        if i in feature_layers:
            picked[i] = h
    hn = rms_norm(h, w.norm, s.eps)
    if s.layers - 1 in picked:
        picked[s.layers - 1] = hn
    feats = torch.cat([picked[i] for i in feature_layers], -1) if feature_layers else None
    return hn, feats
