"""DFlash token trees as SGLang's tree-verify input (what `EagleVerifyInput` carries).

Per request b: the *root* is the bonus token (tree index 0, at position seq_len[b], the first
token without KV), node i of our tree (`fast/tree_build.build_tree`, `tree.build_tree`) has tree
index i + 1 and its parent a smaller tree index, so tree order is already parent-before-child.
W = N + 1 (root + N nodes) is SGLang's `draft_token_num`. Built here, batched, on the tensors'
device and without host syncs: draft tokens, positions (seq_len + depth), the FULL custom mask
(per request W rows of [prefix: True]*seq_len + ancestor-or-self over the W tree tokens, requests
concatenated), and the retrieve links SGLang's greedy / sampling kernels walk: index (global
b * W + i), next_token (first child, smallest index) and next_sibling (next larger index with the
same parent); -1 for none. SGLang is imported only by `verify_input_class` (lazily).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch
from specdec_kernels import reference
from specdec_kernels.reference import mask_positions


@dataclass(frozen=True)
class TreeVerifyTensors:
    draft_token: torch.Tensor  # [bs * W] long, root first per request
    positions: torch.Tensor  # [bs * W] long, seq_len + depth
    custom_mask: torch.Tensor | None  # [W * seq_lens_sum + bs * W * W] bool (FULL_MASK layout)
    retrieve_index: torch.Tensor  # [bs, W] long, b * W + i
    retrieve_next_token: torch.Tensor  # [bs, W] long, first child or -1
    retrieve_next_sibling: torch.Tensor  # [bs, W] long, next sibling or -1
    anc: torch.Tensor  # [bs, W, W] bool, ancestor-or-self (the mask's tree part)
    draft_token_num: int  # W
    max_tree_depth: int  # D + 1: the accept_index width (path incl. the root)
    parents: torch.Tensor | None = None  # [bs, W] long tree index of each parent (root: 0)
    depths: torch.Tensor | None = None  # [bs, W] long (root: 0)
    mask_at: torch.Tensor | None = None  # [bs, W, W] long `mask_positions` (the mask's tree part)


def full_mask(
    anc: torch.Tensor,  # [bs, W, W] bool ancestor-or-self
    seq_lens: torch.Tensor,  # [bs] committed prefix lengths (device)
    seq_lens_sum: int,  # host int: >= sum(seq_lens) (SGLang keeps it on the batch)
    out: torch.Tensor | None = None,  # [>= total] bool / uint8 buffer (a backend's graph mask)
    at: torch.Tensor | None = None,  # [bs, W, W] `mask_positions(seq_lens, W)` if known
) -> torch.Tensor:  # [W * seq_lens_sum + bs * W * W] bool (or `out`'s dtype)
    """SGLang's FULL_MASK: per request W rows of seq_len + W columns, requests concatenated;
    the prefix columns are True, the last W columns the tree's ancestor-or-self rows. `out` may be
    uint8: SGLang 0.5.16's Triton backend hands out its graph mask buffer as `torch.uint8`
    (`get_verify_buffers_to_fill_after_draft`, `init_cuda_graph_state`); `scatter_` needs the
    source in the buffer's dtype. A buffer smaller than the mask (a batch past the backend's
    graph sizes, which verifies eagerly) is not used: the mask is allocated."""
    bs, w, _ = anc.shape
    total = w * seq_lens_sum + bs * w * w
    if out is None or out.numel() < total:
        out = torch.ones(total, dtype=torch.bool, device=anc.device)
    else:
        out = out[:total]
        out.fill_(True)
    if at is None:
        at = mask_positions(seq_lens, w)
    out.scatter_(0, at.reshape(-1), anc.reshape(-1).to(out.dtype))
    return out


def tree_parts(
    tokens: torch.Tensor,  # [bs, N] draft tokens in tree order (parent before child)
    parents: torch.Tensor,  # [bs, N] tree index of each node's parent (0 = root)
    depths: torch.Tensor,  # [bs, N] 1..D
    root: torch.Tensor,  # [bs] the bonus token (root of each tree)
    seq_lens: torch.Tensor,  # [bs] committed prefix length (the root's position)
    max_depth: int,  # D: static bound on depths (the drafter block - 1, or N)
    triton: bool = False,  # one Triton program per row (`specdec_kernels.tree_build`)
) -> TreeVerifyTensors:  # custom_mask None: its size depends on the host's seq_lens_sum
    """Everything SGLang's tree verification reads but the FULL mask (`reference.tree_tensors`
    or its kernel): static shapes and no host sync, so a CUDA graph per batch size can hold it
    (`sglang_tree_stage`)."""
    if triton:
        from specdec_kernels.tree_build import tree_tensors
    else:
        tree_tensors = reference.tree_tensors
    draft, positions, par, dep, index, nxt, sib, anc, at = tree_tensors(
        tokens, parents, depths, root, seq_lens, max_depth)
    return TreeVerifyTensors(draft.reshape(-1), positions.reshape(-1), None, index, nxt, sib, anc,
                             tokens.shape[1] + 1, max_depth + 1, par, dep, at)


def with_mask(t: TreeVerifyTensors, seq_lens: torch.Tensor, seq_lens_sum: int,
              mask_out: torch.Tensor | None = None) -> TreeVerifyTensors:
    """`t` with its FULL custom mask (`full_mask`, into `mask_out` when given)."""
    return replace(t, custom_mask=full_mask(t.anc, seq_lens, seq_lens_sum, mask_out, t.mask_at))


def build_verify_tensors(tokens, parents, depths, root, seq_lens, seq_lens_sum: int,
                         max_depth: int, mask_out: torch.Tensor | None = None
                         ) -> TreeVerifyTensors:
    """`tree_parts` (the same tensors) with the FULL mask of `seq_lens_sum` (host int), into
    `mask_out` when given: everything SGLang's tree verification reads, in one call."""
    return with_mask(tree_parts(tokens, parents, depths, root, seq_lens, max_depth), seq_lens,
                     seq_lens_sum, mask_out)


def check_tree_order(parents: torch.Tensor) -> None:  # [bs, N] (host sync: tests/debug only)
    """Raise unless every node's parent has a smaller tree index (parent before child)."""
    idx = torch.arange(1, parents.shape[1] + 1, device=parents.device)
    bad = (parents < 0) | (parents >= idx)
    if bool(bad.any()):
        raise ValueError(f"parents: every node's parent must precede it (tree index < own "
                         f"index), got {parents.tolist()}")


@cache
def verify_input_class() -> type:
    """`DFlashTreeVerifyInput`: SGLang's `EagleVerifyInput` with the depth bound and the
    irregular-tree marker of our trees (the NGRAM precedent); everything else, including the
    version-specific `generate_attn_arg_prefill`, is SGLang's."""
    from dataclasses import dataclass as _dc

    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    @_dc
    class DFlashTreeVerifyInput(EagleVerifyInput):
        tree_depth: int = 1  # D + 1 (see TreeVerifyTensors.max_tree_depth)

        @property
        def max_tree_depth(self) -> int:
            return self.tree_depth

        @property
        def tree_topk(self) -> int:
            return -1  # irregular tree: no fixed per-level branching

    return DFlashTreeVerifyInput


def make_verify_input(t: TreeVerifyTensors, *, seq_lens_sum: int, seq_lens_cpu: torch.Tensor,
                      topk: int, capture_hidden_mode=None, **extra):
    """A `DFlashTreeVerifyInput` from `t` (SGLang imported here). `topk` >= 2 keeps SGLang's
    tree-path KV compaction on (it is gated on topk > 1); `extra` passes version-specific
    fields (0.5.23: prepared_out_cache_loc, kv_loc_plan)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    cls = verify_input_class()
    return cls(draft_token=t.draft_token, custom_mask=t.custom_mask, positions=t.positions,
               retrieve_index=t.retrieve_index, retrieve_next_token=t.retrieve_next_token,
               retrieve_next_sibling=t.retrieve_next_sibling, retrieve_cum_len=None,
               spec_steps=t.max_tree_depth - 1, topk=max(2, topk),
               draft_token_num=t.draft_token_num,
               capture_hidden_mode=capture_hidden_mode or CaptureHiddenMode.FULL,
               seq_lens_sum=seq_lens_sum, seq_lens_cpu=seq_lens_cpu,
               tree_depth=t.max_tree_depth, **extra)
