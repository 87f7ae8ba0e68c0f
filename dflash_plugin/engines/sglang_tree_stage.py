"""The tree phase of a DFLASH_TREE round, one CUDA graph per batch size (no SGLang import).

From the drafter's hidden states at depths 1..D: the target LM head's top-K per depth
(`sglang_tree_worker.tree_topk`), the tree of N nodes (`fast.tree_build.build_tree`) and every
verify tensor but the FULL mask (`sglang_tree_input.tree_parts`): about 200 small kernels whose
launches, run eagerly, cost more than their work at small shapes. Their shapes depend on the
batch size only, so `TreeStage` copies each round's inputs into static buffers of that batch
size and replays one graph (`fast.graphs.StepGraphs`, captured on first use, thread-local
capture errors: SGLang's other threads keep running). The mask's size depends on the host's
sum of lengths, so the worker adds it eagerly (`sglang_tree_input.with_mask`). Off CUDA, with
`DFLASH_TREE_GRAPHS=0`, or after a failed capture (logged once), the phase runs eagerly, with
the same results.
"""

from __future__ import annotations

import logging
import os

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


class TreeStage:
    """`run(hidden, bonus, seq_lens)` -> `TreeVerifyTensors` without the mask; `topk_fn(hidden)`
    gives `(top_lp, top_ids)` `[bs, D, K]` (the LM head's top-K); `budget` N, `depth` D."""

    def __init__(self, device: torch.device, topk_fn, budget: int, depth: int,
                 graphs: bool = True):
        self.topk_fn, self.budget, self.depth = topk_fn, budget, depth
        self.graphs = StepGraphs(device, graphs, capture_error_mode="thread_local")
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.outputs: dict[int, TreeVerifyTensors] = {}  # the last run's (a graph's own)

    def _buffers(self, hidden, bonus, seq_lens):
        bs = int(hidden.shape[0])
        have = self.inputs.get(bs)
        if have is None or have[0].shape != hidden.shape or have[0].dtype != hidden.dtype:
            h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            have = self.inputs[bs] = (h, torch.empty_like(bonus), torch.empty_like(seq_lens))
            self.graphs.graphs.pop(("tree", bs), None)  # new buffers: capture again
        return bs, have

    def run(self, hidden: torch.Tensor,  # [bs, D, h] the drafter's hidden states, depths 1..D
            bonus: torch.Tensor,  # [bs] each tree's root (the bonus token)
            seq_lens: torch.Tensor,  # [bs] committed prefix lengths (device)
            ) -> TreeVerifyTensors:
        bs, (h, b, lens) = self._buffers(hidden, bonus, seq_lens)
        h.copy_(hidden)
        b.copy_(bonus)
        lens.copy_(seq_lens)

        def phase() -> None:
            top_lp, top_ids = self.topk_fn(h)
            tokens, parents, depths = build_tree(top_lp, top_ids, self.budget)  # [bs, N] each
            self.outputs[bs] = tree_parts(tokens, parents, depths, b, lens, self.depth)

        try:
            self.graphs.run(("tree", bs), phase)
        except RuntimeError as e:
            if not self.graphs.enabled:
                raise
            logger.warning("DFLASH_TREE: capturing the tree phase in a CUDA graph failed (%s); "
                           "it runs eagerly from now on", e)
            self.graphs.enabled = False
            self.graphs.graphs.clear()
            phase()
        return self.outputs[bs]
