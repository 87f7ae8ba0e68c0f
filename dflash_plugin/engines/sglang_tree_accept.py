"""The acceptance of a DFLASH_TREE round, one CUDA graph per batch bucket (no SGLang import
here).

After the target's tree verify, SGLang 0.5.16's EAGLE path (`run_eagle_verify`) walks the tree
(`eagle_sample`'s greedy branch, `verify_tree_greedy`), fills the bonus tokens, moves the
accepted path's target KV to the front of each request's verify block
(`move_accept_tokens_to_target_kvcache`: two Triton kernels build the slot lists, a third moves)
and compacts the predictions and the hidden states (`_compact_accept_to_front`, twice); the
worker then appends the path's drafter KV (`sglang_tree_append`). That is about 40 launches from
Python per round, four of them Triton's, and at the 20M fixture a round is bound by the host
(BENCHMARKS.md, "DFLASH_TREE inside SGLang"). Given the target's token at every node (its
argmax, or at T > 0 a sample: `sglang_tree_verify.target_choice`) every shape depends on the
batch size only, so `AcceptStage` does all of it in one graph per bucket: the walk and SGLang's
outputs in the layout its scheduler reads (`accept_round`: `specdec_kernels.reference.
tree_accept`, whose walk is the fast runtime's `greedy_path`, or its Triton kernel), the
target-KV move through the pool's own `move_kv_cache`, and the drafter-KV append (`append_fn`:
DFLASH's, as `AppendStage` calls it).

The move is not idempotent (a slot can be the source of one pair and the target of a later
one), and a capture runs its function once eagerly first: a bucket is captured with every row
dead (slot 0 moved onto itself, nothing appended) before its first live replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from specdec_kernels import reference

from .sglang_buckets import BucketGraphs, warm_buckets
from .sglang_tree_append import append_kwargs
from .sglang_tree_input import TreeVerifyTensors


@dataclass(frozen=True)
class Accepted:
    """One round's acceptance, as SGLang's greedy tree verify leaves it."""

    predict: torch.Tensor  # [bs * W] int32: row b's first accept_lens[b] = the path's tokens
    accept_lens: torch.Tensor  # [bs] int32: accepted drafts + 1 (the bonus)
    bonus: torch.Tensor  # [bs] int64: the target's token after the last accepted node
    new_seq_lens: torch.Tensor  # [bs] prefix's dtype: prefix + accept_lens


def accept_round(choice, draft, parents, depths, loc, live, depth: int, triton: bool = False):
    """`specdec_kernels.reference.tree_accept` (torch) or its Triton kernel (`triton`): the
    greedy walk of every row's tree and what follows from it: (predict [bs, W] int32 in
    SGLang's layout, path [bs, D+1], n [bs] int32 = accept lengths, bonus [bs], tgt / src
    [bs, D+1]: the target-KV move, the pairs SGLang's `move_accept_tokens_to_target_kvcache`
    moves). The scheduler reads `next_token_ids[b * W : b * W + accept_lens[b]]` only (0.5.16
    `batch_result_processor.py`); the rest of a row is 0 here (SGLang leaves leftovers)."""
    if triton:
        from specdec_kernels.tree_accept import tree_accept

        return tree_accept(choice, draft, parents, loc, live, depth)
    return reference.tree_accept(choice, draft, parents, depths, loc, live, depth)


def path_rows(hidden: torch.Tensor,  # [bs, W, h] the verify's target hidden states
              loc: torch.Tensor, path: torch.Tensor, n: torch.Tensor, prefix: torch.Tensor):
    """`AppendStage`'s tensors for the accepted path (as `accepted_path` reads them after
    SGLang's compaction): hidden [bs, D+1, h], front slots and positions [bs, D+1] int64, commit
    [bs] int32 (`n`; 0 for a dead row: the prefix-valid write leaves it alone)."""
    d1 = path.shape[1]
    hid = hidden.gather(1, path[:, :, None].expand(-1, -1, hidden.shape[-1]))
    pos = prefix.long()[:, None] + torch.arange(d1, device=path.device)
    return hid, loc[:, :d1], pos, n.to(torch.int32)


class AcceptStage:
    """`run(choice, t, loc, hidden, prefix)` -> `Accepted` (fresh tensors); `move_fn(tgt, src)`
    is the target pool's `move_kv_cache`, `append_fn(**kwargs)` DFLASH's drafter-KV append;
    `keep()` as `AppendStage`'s. A subclass walks by other inputs: `walk` (the walk and
    `accept_round`'s outputs from the bucket's buffers), `dead_inputs` (a bucket's first
    capture), `accept` (a round)."""

    def __init__(self, device: torch.device, move_fn: Callable[..., None],
                 append_fn: Callable[..., None], width: int, depth: int, graphs: bool = True,
                 keep: Callable[[], Sequence[torch.Tensor]] | None = None,
                 triton: bool = False):
        self.device, self.move_fn, self.append_fn = device, move_fn, append_fn
        self.triton = triton  # the walk and its outputs in one Triton kernel
        self.width, self.depth = width, depth
        self.graphs = BucketGraphs(device, "accept", graphs, keep)
        self.outputs: dict[int, Accepted] = {}  # the last run's (a graph's own)
        self._ones = torch.ones(1, dtype=torch.bool, device=device)

    def warm(self, max_bs: int, hidden_size: int, dtype: torch.dtype) -> list[int]:
        """Capture the buckets of `warm_buckets(max_bs)` now, every row dead (graphs on; else
        nothing): returns the buckets captured."""
        if not self.graphs.enabled:
            return []
        sizes = warm_buckets(max_bs)
        self.graphs.reserve(sizes[-1])  # one set of input buffers for every bucket
        w, dev = self.width, self.device
        for pad in sizes:
            z = torch.zeros(pad, w, dtype=torch.long, device=dev)
            self._load(self.dead_inputs(pad), (z, z, z, z, torch.zeros(
                pad, w, hidden_size, dtype=dtype, device=dev), z[:, 0]), live=False)
        return sizes if self.graphs.enabled else []

    def dead_inputs(self, pad: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(pad, self.width, dtype=torch.long, device=self.device),)

    def walk(self, inputs, draft, parents, depths, loc, live):
        """`accept_round`'s outputs (the bucket's buffers; `inputs`: this stage's own)."""
        return accept_round(inputs[0], draft, parents, depths, loc, live, self.depth,
                            self.triton)

    def run(self, choice: torch.Tensor,  # [bs, W] long the target's token per tree index
            t: TreeVerifyTensors,  # the round's tree (first bs rows; parents and depths set)
            loc: torch.Tensor,  # [bs * W] the verify's out_cache_loc
            hidden: torch.Tensor,  # [bs * W, h] the verify's target hidden states
            prefix: torch.Tensor,  # [bs] committed lengths before the round
            ) -> Accepted:
        return self.accept((choice,), t, loc, hidden, prefix)

    def accept(self, inputs: tuple[torch.Tensor, ...], t: TreeVerifyTensors, loc, hidden,
               prefix) -> Accepted:
        """A round: `inputs` (`[bs, ...]` each) for `walk`, the rest as `run`'s."""
        bs, w = int(prefix.shape[0]), self.width
        out = self._load(inputs, (t.draft_token.view(bs, w), t.parents, t.depths,
                                  loc.view(bs, w).long(), hidden.view(bs, w, -1), prefix),
                         live=True)
        return Accepted(out.predict[:bs * w].clone(), out.accept_lens[:bs].clone(),
                        out.bonus[:bs].clone(), out.new_seq_lens[:bs].clone())

    def _load(self, inputs, tree, live: bool) -> Accepted:
        bs = int(tree[0].shape[0])
        if self._ones.shape[0] < bs:
            self._ones = torch.ones(bs, dtype=torch.bool, device=self.device)
        pad, bufs = self.graphs.load((*inputs, *tree, self._ones[:bs]))
        mine, (dr, par, dep, lo, hid, pre), lv = bufs[:len(inputs)], bufs[len(inputs):-1], \
            bufs[-1]

        def phase() -> None:
            predict, path, n, bonus, tgt, src = self.walk(mine, dr, par, dep, lo, lv)
            self.move_fn(tgt.reshape(-1), src.reshape(-1))
            self.append_fn(**append_kwargs(*path_rows(hid, lo, path, n, pre)))
            self.outputs[pad] = Accepted(predict.view(-1), n, bonus, pre + n.to(pre.dtype))

        if pad > bs:
            lv[bs:].zero_()  # rows past the batch are dead
        if not live or (self.graphs.enabled and (pad,) not in self.graphs.graphs.graphs):
            lv.zero_()
            self.graphs.run(pad, phase)  # a capture (or a dead eager run): changes nothing
            if not live:
                return self.outputs[pad]
            lv[:bs].fill_(True)
        self.graphs.run(pad, phase)
        return self.outputs[pad]
