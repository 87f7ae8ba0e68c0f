"""One Qwen3 decoder layer (`decoder_layer`) for every model: target, DFlash drafter, SpecFold.
Variants differ by hooks: `attend` (backend, cache writes, injected context K/V), `gate` (SpecFold:
which rows recompute a sublayer, how results fan out), `ops` (linear + pointwise functions).
*Fused* weights: q/k/v rows in one matrix, gate/up rows in one, made once by `layer_weights`; the
module's parameters then become views of them (one copy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch.nn import functional as F

from .rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., dim]
    """HF Qwen3RMSNorm: fp32 normalisation, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm_rope(x, weight, eps, cos, sin, norm: Callable = rms_norm):
    """RoPE of the normed q/k: x [..., heads, head_dim]; weight [heads|1, head_dim]. `norm`: the
    RMSNorm to use (a batch-invariant kernel binds it with functools.partial)."""
    return apply_rope(norm(x, weight, eps), cos, sin)


def add_norm(h, delta, weight, eps, norm: Callable = rms_norm):  # [..., hidden] twice
    """(h + delta, norm(h + delta)): the residual add and the next norm."""
    h = h + delta
    return h, norm(h, weight, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * inter] -> [..., inter]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


POINTWISE = ("rms_norm", "norm_rope", "add_norm", "swiglu")


@dataclass(frozen=True)
class Ops:
    """The functions a layer calls. `linear(x, w[, b])` is the matmul hook (F.linear default)."""
    linear: Callable = F.linear
    rms_norm: Callable = rms_norm
    norm_rope: Callable = norm_rope
    add_norm: Callable = add_norm
    swiglu: Callable = swiglu


EAGER = Ops()
_default = {"ops": EAGER}  # the one table: the ops of a call that passes none


def compiled_ops(base: Ops = EAGER) -> Ops:
    """`base` with its pointwise functions through `torch.compile` (one fused kernel each)."""
    return replace(base, **{n: torch.compile(getattr(base, n), dynamic=True) for n in POINTWISE})


def compile_pointwise(enabled: bool = True) -> None:
    """Opt-in default for every layer (training, fast runtime): compiled pointwise ops (same
    math; the reduction order may differ in the last bit); `False` restores eager."""
    _default["ops"] = compiled_ops() if enabled else EAGER


def default_ops() -> Ops:
    return _default["ops"]


@dataclass
class LayerWeights:
    ln1: torch.Tensor  # [hidden]
    ln2: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    wo: torch.Tensor  # [hidden, heads * head_dim]
    qk_norm: torch.Tensor  # [heads + kv_heads, head_dim]: q_norm per q head, then k_norm
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]
    w_down: torch.Tensor  # [hidden, intermediate]
    heads: int
    kv_heads: int
    eps: float
    bqkv: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim]
    bo: torch.Tensor | None = None  # [hidden]

    @property
    def head_dim(self) -> int:
        return self.qk_norm.shape[-1]

    @property
    def k_norm(self) -> torch.Tensor:  # [head_dim]
        return self.qk_norm[self.heads]


def _back_to_back(ts: list[torch.Tensor]) -> bool:
    """True when the tensors are contiguous and follow each other in one storage."""
    base, offset = ts[0].untyped_storage().data_ptr(), ts[0].storage_offset()
    for t in ts:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != base
                or t.storage_offset() != offset or t.dtype != ts[0].dtype):
            return False
        offset += t.numel()
    return True


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(size[i + 1:]) for i in range(len(size)))


def _rebind(params, views: list[torch.Tensor]) -> None:
    """Point each parameter at its view of a fused tensor (so one copy remains)."""
    with torch.inference_mode(False), torch.no_grad():
        for p, view in zip(params, views):
            p.data = view


def fuse_rows(params: list, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[sum of rows, ...] whose row blocks are `params` (each [rows_i, ...]). A view when they
    already lie back to back (fused before); else a new buffer the parameters are re-pointed to.
    Another dtype: a converted copy, the parameters untouched."""
    ts = [p.detach() for p in params]
    if dtype is not None and dtype != ts[0].dtype:
        return torch.cat(ts).to(dtype)
    size = (sum(t.shape[0] for t in ts), *ts[0].shape[1:])
    if _back_to_back(ts):
        return torch.as_strided(ts[0], size, _contiguous_strides(size))
    with torch.inference_mode(False):
        fused = torch.cat(ts)
    _rebind(params, list(fused.split([t.shape[0] for t in ts])))
    return fused


def _qk_table(qn, kn, heads: int, kv_heads: int, dtype, fuse: bool) -> torch.Tensor:
    """[heads + kv_heads, head_dim]; fused: q_norm / k_norm become views of rows 0 / heads."""
    hd = qn.shape[0]
    size = (heads + kv_heads, hd)
    if not fuse:
        return torch.cat([qn[None].expand(heads, -1), kn[None].expand(kv_heads, -1)])
    q, k = qn.detach(), kn.detach()
    if dtype != q.dtype:
        return torch.cat([q[None].expand(heads, -1), k[None].expand(kv_heads, -1)]).to(dtype)
    if (q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
            and k.storage_offset() == q.storage_offset() + heads * hd
            and q.untyped_storage().nbytes() >= size[0] * hd * q.element_size()):
        return torch.as_strided(q, size, (hd, 1))
    with torch.inference_mode(False):
        table = torch.cat([q[None].expand(heads, -1), k[None].expand(kv_heads, -1)])
    _rebind([qn, kn], [table[0], table[heads]])
    return table


def _eps(norm) -> float:
    return getattr(norm, "variance_epsilon", None) or norm.eps


def layer_weights(layer, dtype: torch.dtype | None = None, fuse: bool = True) -> LayerWeights:
    """The weights of a Qwen3 decoder-layer module (HF `Qwen3DecoderLayer`, `DraftLayer`, SDAR).
    fuse=True (inference): fused once, the module's parameters re-pointed into the fused tensors
    (one copy; idempotent). fuse=False (training): concatenated anew, differentiable."""
    a, m = layer.self_attn, layer.mlp
    hd = a.q_norm.weight.shape[0]
    heads, kvh = a.q_proj.weight.shape[0] // hd, a.k_proj.weight.shape[0] // hd
    dtype = dtype or a.q_proj.weight.dtype

    def one(t):
        return t.detach().to(dtype) if fuse else t

    def rows(ps):
        return fuse_rows(ps, dtype) if fuse else torch.cat(list(ps))
    qkv = (a.q_proj, a.k_proj, a.v_proj)
    bias = a.q_proj.bias is not None
    return LayerWeights(
        ln1=one(layer.input_layernorm.weight), ln2=one(layer.post_attention_layernorm.weight),
        wqkv=rows([p.weight for p in qkv]), wo=one(a.o_proj.weight),
        qk_norm=_qk_table(a.q_norm.weight, a.k_norm.weight, heads, kvh, dtype, fuse),
        w_gate_up=rows([m.gate_proj.weight, m.up_proj.weight]), w_down=one(m.down_proj.weight),
        heads=heads, kv_heads=kvh, eps=_eps(layer.input_layernorm),
        bqkv=rows([p.bias for p in qkv]) if bias else None,
        bo=one(a.o_proj.bias) if a.o_proj.bias is not None else None)


def _linear(ops: Ops, x, w, b=None):
    return ops.linear(x, w) if b is None else ops.linear(x, w, b)


class Rows(NamedTuple):
    """A gate's decision for one sublayer (SpecFold's fold)."""
    take: Callable[[torch.Tensor], torch.Tensor]  # [T, ...] -> [R, ...] rows that recompute
    fan: Callable[[torch.Tensor], torch.Tensor]  # [R, ...] -> [T, ...] each row's source result


# (q [..., heads, hd], k, v [..., kv_heads, hd]: roped, of the rows that recompute)
#   -> [..., heads * hd] attention output of EVERY row of the layer input
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (sublayer input [T, hidden], "attn" | "ffn") -> the rows that recompute that sublayer
Gate = Callable[[torch.Tensor, str], Rows]


def qkv_proj(
    w: LayerWeights,
    x: torch.Tensor,  # [..., hidden] normed layer input
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin broadcastable to [..., 1, head_dim]
    ops: Ops,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [..., heads, hd], k, v [..., kvh, hd]
    qkv = _linear(ops, x, w.wqkv, w.bqkv).unflatten(-1, (-1, w.head_dim))
    qk = ops.norm_rope(qkv[..., :w.heads + w.kv_heads, :], w.qk_norm, w.eps, *rope)
    return qk[..., :w.heads, :], qk[..., w.heads:, :], qkv[..., w.heads + w.kv_heads:, :]


def context_kv(
    w: LayerWeights,
    x: torch.Tensor,  # [..., hidden] injected context (DFlash: the fused target features)
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin broadcastable to [..., 1, head_dim]
    ops: Ops | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # k, v [..., kv_heads, head_dim]
    """KV injection: context through the layer's own k/v rows, k_norm and RoPE (no input norm)."""
    ops = ops or default_ops()
    q_rows = w.heads * w.head_dim
    b = w.bqkv[q_rows:] if w.bqkv is not None else None
    kv = _linear(ops, x, w.wqkv[q_rows:], b).unflatten(-1, (-1, w.head_dim))
    return ops.norm_rope(kv[..., :w.kv_heads, :], w.k_norm, w.eps, *rope), kv[..., w.kv_heads:, :]


def mlp(w: LayerWeights, x: torch.Tensor, ops: Ops) -> torch.Tensor:  # [..., hidden] normed
    return ops.linear(ops.swiglu(ops.linear(x, w.w_gate_up)), w.w_down)


def decoder_layer(
    w: LayerWeights,
    h: torch.Tensor,  # [..., hidden] residual stream (flat [T, hidden] with a gate)
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [..., 1, head_dim] (per row of h)
    attend: Attend,
    ops: Ops | None = None,  # None: `default_ops()`
    gate: Gate | None = None,
) -> torch.Tensor:  # [..., hidden]
    ops = ops or default_ops()
    rows = gate(h, "attn") if gate is not None else None
    x, cos, sin = (h, *rope) if rows is None else (rows.take(t) for t in (h, *rope))
    q, k, v = qkv_proj(w, ops.rms_norm(x, w.ln1, w.eps), (cos, sin), ops)
    out = _linear(ops, attend(q, k, v), w.wo, w.bo)
    if gate is None:
        h, x = ops.add_norm(h, out, w.ln2, w.eps)
        return h + mlp(w, x, ops)
    h = h + out
    rows = gate(h, "ffn")
    return h + rows.fan(mlp(w, ops.rms_norm(rows.take(h), w.ln2, w.eps), ops))
