"""The tree phase of a DFLASH_TREE round, one CUDA graph per batch size (no SGLang import).

From the drafter's hidden states at depths 1..D: the target LM head's top-K per depth
(`sglang_tree_worker.tree_topk`), the tree of N nodes (`fast.tree_build.build_tree`) and every
verify tensor but the FULL mask (`sglang_tree_input.tree_parts`): about 200 small kernels whose
launches, run eagerly, cost more than their work at small shapes. Their shapes depend on the
batch size only, so `TreeStage` copies each round's inputs into static buffers of the batch's
bucket (`bucket`: 1, 2, 4, 8, then multiples of 8; the rows past the batch are ignored, every row
is independent) and replays that bucket's graph (`fast.graphs.StepGraphs`, thread-local capture
errors: SGLang's other threads keep running). The worker captures every bucket up to its
running-request limit at start-up (`warm`): captured on first use instead, the H200's 8-request
rows (requests finishing one by one: batches 8, 7, ... 1) spent their time capturing, 2,093
tok/s against 3,095 eager (2026-12-02). The mask's size depends on the host's
sum of lengths, so the worker adds it eagerly (`sglang_tree_input.with_mask`). Off CUDA, with
`DFLASH_TREE_GRAPHS=0`, or after a failed capture (logged once), the phase runs eagerly, with
the same results.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from ..errors import ConfigError
from ..fast.graphs import StepGraphs
from ..fast.tree_build import build_tree
from .sglang_tree_input import TreeVerifyTensors, tree_parts

logger = logging.getLogger(__name__)

ENV = "DFLASH_TREE_GRAPHS"


def graphs_enabled(environ=os.environ) -> bool:
    """`DFLASH_TREE_GRAPHS`: 1 (default) or 0; a clear error otherwise."""
    raw = environ.get(ENV, "1").strip() or "1"
    if raw not in ("0", "1"):
        raise ConfigError(ENV, f"must be 0 or 1 (capture the tree phase in CUDA graphs), "
                               f"got {raw!r}")
    return raw == "1"


def bucket(bs: int) -> int:
    """The graph batch size that holds `bs` rows: 1, 2, 4, 8, then the next multiple of 8."""
    if bs < 1:
        raise ValueError(f"batch size must be >= 1, got {bs}")
    return 1 << (bs - 1).bit_length() if bs <= 8 else -(-bs // 8) * 8


WARM_MAX_BS = 256  # start-up captures stop here (35 graphs); larger buckets: on first use


def warm_buckets(max_bs: int) -> list[int]:
    """The buckets `TreeStage.warm` captures for a running-request limit of `max_bs`."""
    return sorted({bucket(b) for b in range(1, min(max_bs, WARM_MAX_BS) + 1)})


class TreeStage:
    """`run(hidden, bonus, seq_lens)` -> `TreeVerifyTensors` without the mask; `topk_fn(hidden)`
    gives `(top_lp, top_ids)` `[bs, D, K]` (the LM head's top-K); `budget` N, `depth` D."""

    def __init__(self, device: torch.device, topk_fn, budget: int, depth: int,
                 graphs: bool = True):
        self.device, self.topk_fn, self.budget, self.depth = device, topk_fn, budget, depth
        self.graphs = StepGraphs(device, graphs, capture_error_mode="thread_local")
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.outputs: dict[int, TreeVerifyTensors] = {}  # the last run's (a graph's own)

    def _buffers(self, pad: int, hidden, bonus, seq_lens):
        have = self.inputs.get(pad)
        if have is None or have[0].shape[1:] != hidden.shape[1:] or \
                have[0].dtype != hidden.dtype:
            h = hidden.new_zeros((pad, *hidden.shape[1:]))
            have = self.inputs[pad] = (h, bonus.new_zeros(pad), seq_lens.new_zeros(pad))
            self.graphs.graphs.pop(("tree", pad), None)  # new buffers: capture again
        return have

    def warm(self, max_bs: int, hidden_size: int, dtype: torch.dtype) -> list[int]:
        """Capture the buckets of `warm_buckets(max_bs)` now (graphs on; else nothing): returns
        the buckets captured. Zero inputs: every captured tensor is rewritten by each run."""
        if not self.graphs.enabled:
            return []
        sizes = warm_buckets(max_bs)
        for pad in sizes:
            self.run(torch.zeros(pad, self.depth, hidden_size, dtype=dtype, device=self.device),
                     torch.zeros(pad, dtype=torch.long, device=self.device),
                     torch.ones(pad, dtype=torch.long, device=self.device))
        return sizes if self.graphs.enabled else []

    def run(self, hidden: torch.Tensor,  # [bs, D, h] the drafter's hidden states, depths 1..D
            bonus: torch.Tensor,  # [bs] each tree's root (the bonus token)
            seq_lens: torch.Tensor,  # [bs] committed prefix lengths (device)
            ) -> TreeVerifyTensors:  # every field's first bs rows (views of the bucket's)
        bs = int(hidden.shape[0])
        pad = bucket(bs)
        h, b, lens = self._buffers(pad, hidden, bonus, seq_lens)
        h[:bs].copy_(hidden)
        b[:bs].copy_(bonus)
        lens[:bs].copy_(seq_lens)

        def phase() -> None:
            top_lp, top_ids = self.topk_fn(h)
            tokens, parents, depths = build_tree(top_lp, top_ids, self.budget)  # [bs, N] each
            self.outputs[pad] = tree_parts(tokens, parents, depths, b, lens, self.depth)

        try:
            self.graphs.run(("tree", pad), phase)
        except RuntimeError as e:
            if not self.graphs.enabled:
                raise
            logger.warning("DFLASH_TREE: capturing the tree phase in a CUDA graph failed (%s); "
                           "it runs eagerly from now on", e)
            self.graphs.enabled = False
            self.graphs.graphs.clear()
            phase()
        return first_rows(self.outputs[pad], bs)


def first_rows(t: TreeVerifyTensors, bs: int) -> TreeVerifyTensors:
    """`t` of a padded batch cut to its first `bs` requests (flat fields: bs * W entries; a
    request's retrieve_index b * W + i does not depend on the batch size)."""
    w = t.draft_token_num
    return replace(t, draft_token=t.draft_token[:bs * w], positions=t.positions[:bs * w],
                   retrieve_index=t.retrieve_index[:bs],
                   retrieve_next_token=t.retrieve_next_token[:bs],
                   retrieve_next_sibling=t.retrieve_next_sibling[:bs], anc=t.anc[:bs])
