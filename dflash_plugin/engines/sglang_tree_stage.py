"""The tree phase of a DFLASH_TREE round, one CUDA graph per batch bucket (no SGLang import).

From the drafter's hidden states at depths 1..D: the target LM head's top-K per depth
(`sglang_tree_worker.tree_topk`), the tree of N nodes (`fast.tree_build.build_tree`) and every
verify tensor but the FULL mask (`sglang_tree_input.tree_parts`): about 200 small kernels whose
launches, run eagerly, cost more than their work at small shapes. Their shapes depend on the
batch size only: `sglang_buckets.BucketGraphs` pads the batch to its bucket and replays that
bucket's graph (every row is independent; padded rows are cut off by `first_rows`). The mask's
size depends on the host's sum of lengths, so the worker writes it eagerly, a fill and a scatter
to the positions the graph computed (`sglang_tree_input.with_mask`, `mask_positions`).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from ..errors import ConfigError
from ..fast.tree_build import build_tree
from .sglang_buckets import BucketGraphs, warm_buckets
from .sglang_tree_input import TreeVerifyTensors, tree_parts

KERNELS_ENV = "DFLASH_TREE_KERNELS"


def triton_kernels_from_env(device: torch.device, environ=os.environ) -> bool:
    """`DFLASH_TREE_KERNELS`: torch (default) or triton: the tree build and the verify tensors
    (`specdec_kernels.tree_build`: two launches in place of about 180) and the greedy acceptance
    (`specdec_kernels.tree_accept`, one in place of about 40) as Triton kernels; CUDA only,
    torch elsewhere. A clear error otherwise."""
    raw = environ.get(KERNELS_ENV, "torch").strip().lower() or "torch"
    if raw not in ("torch", "triton"):
        raise ConfigError(KERNELS_ENV, f"must be torch or triton (the tree phase's and the "
                                       f"acceptance's kernels), got {raw!r}")
    return raw == "triton" and device.type == "cuda"


class TreeStage:
    """`run(hidden, bonus, seq_lens)` -> `TreeVerifyTensors` without the mask; `topk_fn(hidden)`
    gives `(top_lp, top_ids)` `[bs, D, K]` (the LM head's top-K); `budget` N, `depth` D;
    `triton_build`: the build and the verify tensors as Triton kernels (`build_tree(...,
    triton=True)`, `tree_parts(..., triton=True)`)."""

    def __init__(self, device: torch.device, topk_fn, budget: int, depth: int,
                 graphs: bool = True, triton_build: bool = False):
        self.device, self.topk_fn, self.budget, self.depth = device, topk_fn, budget, depth
        self.triton_build = triton_build
        self.graphs = BucketGraphs(device, "tree", graphs)
        self.outputs: dict[int, TreeVerifyTensors] = {}  # the last run's (a graph's own)

    def warm(self, max_bs: int, hidden_size: int, dtype: torch.dtype) -> list[int]:
        """Capture the buckets of `warm_buckets(max_bs)` now (graphs on; else nothing): returns
        the buckets captured. Zero inputs: every captured tensor is rewritten by each run."""
        if not self.graphs.enabled:
            return []
        sizes = warm_buckets(max_bs)
        self.graphs.reserve(sizes[-1])  # one set of input buffers for every bucket
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
        pad, (h, b, lens) = self.graphs.load((hidden, bonus, seq_lens))

        def phase() -> None:
            top_lp, top_ids = self.topk_fn(h)
            self.outputs[pad] = self.tree(top_lp, top_ids, b, lens)

        self.graphs.run(pad, phase)
        return first_rows(self.outputs[pad], bs)

    def tree(self, top_lp, top_ids, bonus, seq_lens) -> TreeVerifyTensors:
        """The tree of the top-K `[bs, D, K]` and its verify tensors (inside the phase)."""
        tokens, parents, depths = build_tree(top_lp, top_ids, self.budget,
                                             triton=self.triton_build)  # [bs, N] each
        return tree_parts(tokens, parents, depths, bonus, seq_lens, self.depth,
                          triton=self.triton_build)


def first_rows(t: TreeVerifyTensors, bs: int) -> TreeVerifyTensors:
    """`t` of a padded batch cut to its first `bs` requests (flat fields: bs * W entries; a
    request's retrieve_index b * W + i does not depend on the batch size)."""
    w = t.draft_token_num
    return replace(t, draft_token=t.draft_token[:bs * w], positions=t.positions[:bs * w],
                   retrieve_index=t.retrieve_index[:bs],
                   retrieve_next_token=t.retrieve_next_token[:bs],
                   retrieve_next_sibling=t.retrieve_next_sibling[:bs], anc=t.anc[:bs],
                   parents=t.parents[:bs], depths=t.depths[:bs], mask_at=t.mask_at[:bs])
