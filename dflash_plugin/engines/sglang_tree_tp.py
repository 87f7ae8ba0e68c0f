"""The tree's top-K over the target's LM head (`tree_topk`), and that head under tensor
parallelism (`--tp-size N`, `replicated_head`).

Under TP every rank's scheduler runs its own `DFlashTreeWorker`, and the ranks must build the
same tree each round: its tokens and positions are the verify forward's input on every rank,
whose collectives need equal shapes and whose outputs only mean something when the inputs agree.
The drafter's hidden states are replicated (they leave an all-reduce), but the target's LM head
is vocab-parallel: each rank holds a padded shard of rows. So each rank gathers the whole head
once, at start, and the tree's top-K runs over the same full `[V, hidden]` matrix on every rank
(same kernel, same inputs: the same tree), with no collective inside a round or a CUDA graph.
The cost is one unsharded LM head per rank (Qwen3-8B: 151,936 x 4,096 bf16, 1.2 GB) and the
head's GEMM unsharded in the tree phase.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def vocab_rows(shards: torch.Tensor, starts: list[int], counts: list[int]) -> torch.Tensor:
    """The real vocab rows of a vocab-parallel head, in token-id order: `shards` `[tp, rows,
    hidden]` (every rank's padded shard), rank r's first `counts[r]` rows being token ids
    `starts[r] ...`. -> `[V, hidden]`. ValueError unless the real rows tile `[0, V)` exactly
    (padding rows are never drafted)."""
    tp, rows = int(shards.shape[0]), int(shards.shape[1])
    if len(starts) != tp or len(counts) != tp:
        raise ValueError(f"vocab shards: {tp} shards but {len(starts)} starts, "
                         f"{len(counts)} counts")
    spans = sorted((s, c, r) for r, (s, c) in enumerate(zip(starts, counts)) if c > 0)
    end = 0
    for s, c, r in spans:
        if s != end or c > rows:
            raise ValueError(f"vocab shards: rank {r} holds ids [{s}, {s + c}) in {rows} rows;"
                             f" expected ids from {end}")
        end = s + c
    return torch.cat([shards[r, :c] for _, c, r in spans], dim=0)


def replicated_head(lm_head, group):
    """The head the tree's top-K reads (`tree_topk`): `lm_head` itself at
    TP 1 (`group` None or of one rank); else an object with the whole head as `.weight`
    `[V, hidden]` and no shard indices, gathered from every rank of `group` (SGLang's TP
    `GroupCoordinator`: `all_gather`). Collective: every rank must call it, at start."""
    if group is None or int(group.world_size) == 1:
        return lm_head
    weight = lm_head.weight  # [rows, hidden], the same padded row count on every rank
    shard = getattr(lm_head, "shard_indices", None)
    if shard is None:
        raise ValueError("tp_size > 1 but the target's LM head has no shard indices")
    if int(getattr(shard, "num_added_elements", 0)) != 0:
        raise ValueError("tp_size > 1 with added (LoRA) vocab rows: not supported by DFLASH_TREE")
    tp = int(group.world_size)
    own = torch.tensor([int(shard.org_vocab_start_index), int(shard.num_org_elements)],
                       dtype=torch.int64, device=weight.device)
    spans = group.all_gather(own, dim=0).view(tp, 2).tolist()  # [[start, count] per rank]
    shards = group.all_gather(weight.detach(), dim=0).view(tp, *weight.shape)
    full = vocab_rows(shards, [s for s, _ in spans], [c for _, c in spans]).contiguous()
    return SimpleNamespace(weight=full, shard_indices=None)


def head_logits(hidden: torch.Tensor, lm_head) -> tuple[torch.Tensor, int]:
    """The target LM head's fp32 logits `[bs, D, V]` over the drafter's hidden states `[bs, D,
    hidden]` (under TP the whole head: `sglang_tree_tp`) and the token id of column 0. Only the
    head's real vocab rows count: SGLang's `ParallelLMHead.weight` is padded to a multiple of 64
    rows (`padding_size`, `vocab_parallel_embedding.py`), and a padded row must never be
    drafted; `shard_indices.num_org_elements` / `org_vocab_start_index` give the real rows, as
    in DFLASH's own greedy head (`dflash_worker_v2.py` `_DflashDraftSampler`, 0.5.16). Added
    (LoRA) vocab is not drafted."""
    weight = lm_head.weight
    start, num_org = head_rows(lm_head)
    return torch.nn.functional.linear(hidden.to(weight.dtype), weight[:num_org]).float(), start


def head_rows(lm_head) -> tuple[int, int]:
    """(token id of the head's first row, its real vocab rows): padding and added rows cut."""
    shard = getattr(lm_head, "shard_indices", None)
    if shard is None:
        return 0, int(lm_head.weight.shape[0])
    return int(shard.org_vocab_start_index), int(shard.num_org_elements)


def tree_topk(hidden: torch.Tensor, lm_head, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`k` log-probs and token ids `[bs, D, k]` of the target LM head over the drafter's
    hidden states (`head_logits`)."""
    logits, start = head_logits(hidden, lm_head)
    top_lp, top_ids = logits.log_softmax(-1).topk(k, dim=-1)
    return top_lp, (top_ids + start) if start else top_ids
