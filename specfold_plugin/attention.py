"""Streaming attention states and their merge (torch reference; kernels mirror these).

An attention *state* of a query over a set of keys is (out, max, normaliser): max m = the largest
scaled score, normaliser l = sum exp(score - m), out = sum exp(score - m) v / l. Two states of the
same query over disjoint key sets merge exactly (online softmax) into the state over their union;
an empty key set is (0, -inf, 0). All states are fp32.
"""

from __future__ import annotations

import torch

# out [..., q, hd], max [..., q], normaliser [..., q]
State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def attention_state(
    q: torch.Tensor,  # [b, heads, sq, hd]
    k: torch.Tensor,  # [b, kv_heads, sk, hd]; head h reads kv head h // (heads // kv_heads)
    v: torch.Tensor,  # [b, kv_heads, sk, hd]
    scale: float,
) -> State:  # out [b, heads, sq, hd], max [b, heads, sq], normaliser [b, heads, sq]
    b, heads, sq, hd = q.shape
    kvh, sk = k.shape[1], k.shape[2]
    if sk == 0:
        return (q.new_zeros(q.shape, dtype=torch.float32),
                q.new_full((b, heads, sq), -torch.inf, dtype=torch.float32),
                q.new_zeros((b, heads, sq), dtype=torch.float32))
    qg = q.float().reshape(b, kvh, heads // kvh, sq, hd)
    s = (qg @ k.float()[:, :, None].transpose(-1, -2)) * scale  # [b, kvh, g, sq, sk]
    m = s.amax(-1)
    p = torch.exp(s - m[..., None])
    lsum = p.sum(-1)
    out = (p @ v.float()[:, :, None]) / lsum[..., None]
    return out.reshape(b, heads, sq, hd), m.reshape(b, heads, sq), lsum.reshape(b, heads, sq)


def merge_states(a: State, b: State) -> State:
    """The state over the union of two disjoint key sets (b must not be empty where a is)."""
    (oa, ma, la), (ob, mb, lb) = a, b
    m = torch.maximum(ma, mb)
    wa = la * torch.exp(ma - m)  # exp(-inf) = 0 for an empty a
    wb = lb * torch.exp(mb - m)
    lsum = wa + wb
    out = (oa * wa[..., None] + ob * wb[..., None]) / lsum[..., None]
    return out, m, lsum
