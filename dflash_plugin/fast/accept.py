"""Greedy acceptance of one round of the fast runtime, in place on the decoder's persistent
state (`FastDecoder._accept`, and `tree_loop` along the walked path): the longest agreeing
prefix + the target's next token, capped by the new-token limit and cut after a stop token;
output buffer, lengths, done flags and per-round history. No host sync. `compile_steps` swaps in
a `torch.compile`d version (with the layers' pointwise pieces).
"""

from __future__ import annotations

import torch

from .qwen3 import compile_pointwise

MAX_STOPS = 8  # stop ids per decoder (the `stops` tensor's length)


def accept_round(
    tgt: torch.Tensor,  # [batch, q] the target's greedy ids at the block's positions
    drf: torch.Tensor,  # [batch, q - 1] the drafted ids
    stops: torch.Tensor,  # [MAX_STOPS] stop ids, -1 = unused
    max_new: torch.Tensor,  # [] long
    out_buf: torch.Tensor,  # [batch, max_len + 1] long; last column: dump slot
    out_len: torch.Tensor,  # [batch] long
    anchor: torch.Tensor,  # [batch] long
    lengths: torch.Tensor,  # [batch] long: committed cache lengths
    done: torch.Tensor,  # [batch] bool
    history: torch.Tensor,  # [rounds, 3, batch] long: n, accepted, live per round
    round_idx: torch.Tensor,  # [1] long
) -> None:
    """Greedy acceptance of one round, in place on the decoder state (no host sync): commit the
    longest agreeing prefix + the target's next token, capped by max_new and cut after a stop."""
    q = tgt.shape[1]
    acc = (drf == tgt[:, :-1]).long().cumprod(-1).sum(-1)  # [batch]
    n = torch.minimum(acc + 1, max_new - out_len)
    j = torch.arange(q, device=tgt.device)
    is_stop = (tgt[..., None] == stops).any(-1) & (j[None] < n[:, None])
    hit = is_stop.any(-1)
    n = torch.where(hit, torch.where(is_stop, j, q).amin(-1) + 1, n)
    live = ~done
    n = torch.where(live, n, 0)
    dump = out_buf.shape[1] - 1
    cols = torch.where(j[None] < n[:, None], out_len[:, None] + j, dump)
    out_buf.scatter_(1, cols, tgt)
    out_len += n
    last = tgt.gather(1, (n - 1).clamp_min(0)[:, None])[:, 0]
    anchor.copy_(torch.where(n > 0, last, anchor))
    lengths += n
    done |= (hit & live) | (out_len >= max_new)
    history.index_copy_(0, round_idx, torch.stack([n, acc, live.long()])[None])
    round_idx += live.any().long() * (round_idx < history.shape[0] - 1).long()


_accept_impl = {"fn": accept_round}


def compile_steps(enabled: bool = True) -> None:
    """Opt-in `torch.compile` of the runtime's small ops: the pointwise pieces of every layer
    (`qwen3.compile_pointwise`) and the acceptance step (about 40 tiny kernels eager, a few
    fused ones compiled). Same results; compiled lazily in a graph's eager warm-up."""
    compile_pointwise(enabled)
    _accept_impl["fn"] = torch.compile(accept_round, dynamic=True) if enabled else accept_round
