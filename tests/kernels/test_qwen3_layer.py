"""The one Qwen3 layer (`specdec_kernels.qwen3`) and RoPE (`specdec_kernels.rope`) against Hugging
Face's `Qwen3DecoderLayer` / `Qwen3RotaryEmbedding` (fp32, random weights and input, rtol/atol
1e-5), the load-time fusion (one copy, idempotent), and the gate hook (pure torch)."""

import pytest
import torch
from specdec_kernels.qwen3 import Rows, decoder_layer, layer_weights
from specdec_kernels.rope import rope_cos_sin
from torch.nn import functional as F
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: same math, reduction order may differ


def _config(heads=4, kv_heads=2):
    cfg = Qwen3Config(hidden_size=48, intermediate_size=80, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=16, num_hidden_layers=1,
                      vocab_size=32, rope_parameters={"rope_type": "default",
                                                      "rope_theta": 10000.0})
    cfg._attn_implementation = "sdpa"
    return cfg


def _hf_layer(cfg, seed=0):
    torch.manual_seed(seed)
    layer = Qwen3DecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0) + (p.dim() == 1))
    return layer


def causal_attend(q, k, v):  # [b, s, heads | kv_heads, hd] -> [b, s, heads * hd]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).flatten(2)


def _rope(cfg, pos):
    cos, sin = rope_cos_sin(pos, cfg.head_dim, 10000.0, torch.float32)
    return cos[..., None, :], sin[..., None, :]


def test_rope_tables_equal_hf():
    cfg = _config()
    pos = torch.tensor([[0, 1, 5, 77, 4095]])
    cos, sin = Qwen3RotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)
    ours = rope_cos_sin(pos, cfg.head_dim, 10000.0, torch.float32)
    torch.testing.assert_close(ours[0], cos, **TOL)
    torch.testing.assert_close(ours[1], sin, **TOL)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("fuse", [True, False])
def test_decoder_layer_equals_hf(heads, kv_heads, fuse):
    cfg = _config(heads, kv_heads)
    layer = _hf_layer(cfg)
    h = torch.randn(3, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(7)[None].expand(3, 7) + torch.tensor([[0], [5], [11]])
    with torch.no_grad():
        ref = layer(h, position_embeddings=Qwen3RotaryEmbedding(cfg)(h, pos))
        ref = ref[0] if isinstance(ref, tuple) else ref
        ours = decoder_layer(layer_weights(layer, fuse=fuse), h, _rope(cfg, pos), causal_attend)
        again = layer(h, position_embeddings=Qwen3RotaryEmbedding(cfg)(h, pos))
    again = again[0] if isinstance(again, tuple) else again
    torch.testing.assert_close(ours, ref, **TOL)
    assert torch.equal(again, ref)  # the HF module works unchanged on re-pointed parameters


def test_fusion_is_one_copy_and_idempotent():
    layer = _hf_layer(_config())
    a, m = layer.self_attn, layer.mlp
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    w = layer_weights(layer)
    ptr = w.wqkv.data_ptr()
    assert a.q_proj.weight.data_ptr() == ptr
    size = w.wqkv.element_size()
    assert a.k_proj.weight.data_ptr() == ptr + a.q_proj.weight.numel() * size
    assert m.gate_proj.weight.data_ptr() == w.w_gate_up.data_ptr()
    assert m.up_proj.weight.data_ptr() == w.w_gate_up.data_ptr() + m.gate_proj.weight.numel() * size
    assert a.q_norm.weight.data_ptr() == w.qk_norm.data_ptr()
    assert a.k_norm.weight.data_ptr() == w.qk_norm[w.heads].data_ptr()
    assert w.wo.data_ptr() == a.o_proj.weight.data_ptr()
    assert w.w_down.data_ptr() == m.down_proj.weight.data_ptr()
    for n, p in layer.named_parameters():
        assert torch.equal(p, before[n]), n
    w2 = layer_weights(layer)  # fused already: views, nothing new
    assert (w2.wqkv.data_ptr(), w2.w_gate_up.data_ptr(), w2.qk_norm.data_ptr()) == (
        ptr, w.w_gate_up.data_ptr(), w.qk_norm.data_ptr())
    assert torch.equal(w2.wqkv, w.wqkv) and torch.equal(w2.qk_norm, w.qk_norm)
    w16 = layer_weights(layer, torch.float64)  # another dtype: a converted copy
    assert w16.wqkv.dtype == torch.float64 and a.q_proj.weight.dtype == torch.float32


def test_unfused_weights_are_differentiable():
    layer = _hf_layer(_config())
    h = torch.randn(2, 5, 48)
    pos = torch.arange(5)[None].expand(2, 5)
    decoder_layer(layer_weights(layer, fuse=False), h, _rope(_config(), pos),
                  causal_attend).square().sum().backward()
    grads = [p.grad for p in layer.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_gate_hook_recomputes_only_taken_rows():
    """A gate that recomputes rows 0..2 and lets rows 3..5 reuse them (row i + 3 <- row i) gives
    rows 3..5 the outputs rows 0..2 would have with their own input (a folded row's sublayer
    results are its source's), and rows 0..2 their dense result."""
    cfg = _config()
    w = layer_weights(_hf_layer(cfg))
    h = torch.randn(3, cfg.hidden_size)
    h = torch.cat([h, h + 1e-3])  # [6, hidden]: rows 3..5 near rows 0..2
    pos = torch.tensor([4, 5, 6, 4, 5, 6])
    rope = _rope(cfg, pos)
    src = torch.tensor([0, 1, 2, 0, 1, 2])
    seen = []

    def gate(x, site):
        seen.append((site, x.shape[0]))
        return Rows(take=lambda t: t[:3], fan=lambda t: t[src])

    def attend(q, k, v):  # each row attends over itself only
        return v.repeat_interleave(q.shape[1] // v.shape[1], 1).flatten(1)[src]

    out = decoder_layer(w, h, rope, attend, gate=gate)
    assert seen == [("attn", 6), ("ffn", 6)]
    dense = decoder_layer(w, h[:3], tuple(t[:3] for t in rope),
                          lambda q, k, v: v.repeat_interleave(q.shape[1] // v.shape[1], 1)
                          .flatten(1))
    torch.testing.assert_close(out[:3], dense, **TOL)
    torch.testing.assert_close(out[3:] - h[3:], dense - h[:3], **TOL)
