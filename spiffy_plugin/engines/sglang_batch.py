"""Draft rows inside one SGLang forward (SGLang objects duck-typed: this module imports none).

A *draft row* is one more sequence of the ForwardBatch, scored with its root request's block
positions. Its req_to_token row repeats the root's committed-prefix slots, so the prefix K/V is
shared (read in place, neither recomputed nor copied), and ends in `block_size` slots freshly
allocated for the draft block's own K/V. Each row sees the prefix and its own block only (every
backend reads a sequence's K/V through its req_to_token row). `DraftRows` owns the rows and slots
of one forward and frees them in `release`. Fields and pool methods an older SGLang lacks are
probed (see `spiffy_plugin.engines.versions`).
"""

from __future__ import annotations

import dataclasses

import torch

# ForwardBatch fields with one entry per sequence (tensors, then lists): draft rows repeat their
# root's entry, except the req_to_token row.
ROW_TENSORS = ("req_pool_indices", "seq_lens", "seq_lens_cpu", "orig_seq_lens", "extend_seq_lens",
               "extend_prefix_lens", "req_pool_indices_cpu", "dllm_prompt_mask")
ROW_LISTS = ("extend_prefix_lens_cpu", "extend_seq_lens_cpu", "extend_logprob_start_lens_cpu",
             "top_logprobs_nums", "token_ids_logprobs", "rids", "lora_ids", "mm_inputs",
             "watermark_prompt_tail_ids", "watermark_context_hash_history")
# Features whose per-sequence state a draft row cannot simply repeat: forwards using them score
# the root only (one step per forward, still exact).
UNSUPPORTED = ("spec_info", "encoder_lens", "input_embeds", "replace_embeds", "mrope_positions",
               "mamba_track_indices", "global_num_tokens_cpu", "tbo_split_seq_index",
               "dllm_input_preparation_state", "extend_input_logprob_token_ids_gpu")


def unsupported(fb, block_size: int, page_size: int) -> str | None:
    """Why draft rows cannot join this ForwardBatch, or None."""
    if block_size % page_size:
        return f"block size {block_size} is not a multiple of the KV page size {page_size}"
    if fb.return_logprob:
        return "logprobs requested"
    for name in UNSUPPORTED:
        if getattr(fb, name, None) is not None:
            return f"ForwardBatch.{name} is set"
    if any(x is not None for x in (fb.lora_ids or [])):
        return "LoRA adapters"
    if any(x is not None for x in (fb.mm_inputs or [])):
        return "multimodal inputs"
    n = fb.batch_size
    if fb.input_ids.numel() != n * block_size or _host(fb, "extend_seq_lens") != [block_size] * n:
        return "not one block per request"
    return None


def _host(fb, name: str) -> list[int]:
    """A per-sequence length list: its host mirror where SGLang filled one."""
    v = getattr(fb, name + "_cpu", None)
    return [int(x) for x in (v if v is not None else getattr(fb, name).tolist())]


class DraftRows:
    """The req_to_token rows and KV slots of one forward's draft rows."""

    def __init__(self, model_runner):
        self.mr = model_runner
        self.rows: list[int] = []
        self.slots: torch.Tensor | None = None  # [n * block] int64

    def budget(self, batch_rows: int, block_size: int) -> int:
        """Draft rows that fit now: free req_to_token rows, free KV slots (never evicting the
        prefix cache), and the runner's batch limit."""
        mr = self.mr
        limit = min(mr.req_to_token_pool.available_size(),
                    mr.token_to_kv_pool_allocator.available_size() // block_size)
        cap = getattr(mr, "max_running_requests", None)
        return max(0, limit if cap is None else min(limit, cap - batch_rows))

    def allocate(self, n: int, block_size: int) -> bool:
        assert not self.rows and self.slots is None, "release the previous rows first"
        if n == 0:
            return False
        rows = alloc_rows(self.mr.req_to_token_pool, n)
        if rows is None:
            return False
        slots = self.mr.token_to_kv_pool_allocator.alloc(n * block_size)
        if slots is None:
            free_rows(self.mr.req_to_token_pool, rows)
            return False
        self.rows, self.slots = list(rows), slots.to(torch.int64)
        return True

    def block_slots(self, r: int, block_size: int) -> torch.Tensor:  # [block] of draft row r
        return self.slots[r * block_size: (r + 1) * block_size]

    def release(self) -> None:
        if self.slots is not None:
            self.mr.token_to_kv_pool_allocator.free(self.slots)
        if self.rows:
            free_rows(self.mr.req_to_token_pool, self.rows)
        self.rows, self.slots = [], None


def alloc_rows(pool, n: int) -> list[int] | None:
    """`n` req_to_token rows bound to no request: `ReqToTokenPool.alloc_rows` (SGLang >= 0.5.19),
    else the same taken from the pool's free list, as that method does."""
    if hasattr(pool, "alloc_rows"):
        return pool.alloc_rows(n)
    return take_free_rows(pool, n)


def free_rows(pool, rows: list[int]) -> None:
    if hasattr(pool, "free_rows"):
        pool.free_rows(rows)
    else:
        pool.free_slots.extend(rows)


def take_free_rows(pool, n: int) -> list[int] | None:
    """SGLang 0.5.19's `alloc_rows` on an older pool (free list `free_slots`, row generations)."""
    if n > len(pool.free_slots):
        return None
    if n == 0:
        return []
    rows = pool.free_slots[-n:]
    del pool.free_slots[-n:]
    if getattr(pool, "req_generation", None) is not None:
        pool.req_generation[rows] += 1
    return rows


def extend_batch(
    fb,  # ForwardBatch in DLLM_EXTEND mode: batch_size requests, one block each
    owners: list[int],  # root request (batch index) of each draft row
    draft_ids: torch.Tensor,  # [n, block] draft canvases
    rows: DraftRows,  # allocated: n req_to_token rows, n * block slots
    block_size: int,
):
    """A new ForwardBatch: the original sequences first (unchanged), then the draft rows. Writes
    the draft rows' req_to_token entries (root's prefix slots, then their own block slots)."""
    b, n, bs = fb.batch_size, len(owners), block_size
    table = rows.mr.req_to_token_pool.req_to_token
    prefix = _host(fb, "extend_prefix_lens")
    for r, i in enumerate(owners):
        root = int(fb.req_pool_indices[i])
        p = prefix[i]
        table[rows.rows[r], :p] = table[root, :p]
        table[rows.rows[r], p: p + bs] = rows.block_slots(r, bs).to(table.dtype)
    row_of = torch.tensor(list(range(b)) + list(owners), dtype=torch.long)
    new = {}
    for name in ROW_TENSORS:
        t = getattr(fb, name, None)
        if t is not None:
            new[name] = t[row_of.to(t.device)].clone()
    for name in ROW_LISTS:
        v = getattr(fb, name, None)
        if v is not None:
            new[name] = [v[i] for i in row_of.tolist()]
    for name in ("req_pool_indices", "req_pool_indices_cpu"):
        if name in new:
            new[name][b:] = torch.tensor(rows.rows, dtype=new[name].dtype)

    def per_token(t):  # [b * block] -> [(b + n) * block], draft rows repeating their root's
        return t.view(b, bs)[row_of.to(t.device)].reshape(-1).clone()

    new["input_ids"] = per_token(fb.input_ids)
    new["input_ids"][b * bs:] = draft_ids.reshape(-1).to(new["input_ids"])
    new["out_cache_loc"] = per_token(fb.out_cache_loc)
    new["out_cache_loc"][b * bs:] = rows.slots.to(new["out_cache_loc"])
    new["positions"] = per_token(fb.positions)
    lens = new["seq_lens_cpu"] if "seq_lens_cpu" in new else new["seq_lens"].cpu()
    tokens = (b + n) * bs
    start = fb.extend_start_loc
    new.update(
        batch_size=b + n, seq_lens_sum=int(lens.sum()), extend_num_tokens=tokens,
        extend_start_loc=None if start is None else
        torch.arange(b + n, dtype=start.dtype, device=start.device) * bs,
        global_num_token_non_padded_cpu=tokens,
        global_num_token_non_padded=_count_like(getattr(fb, "global_num_token_non_padded", None),
                                                tokens),
        forward_metadata_ready=False, kv_loc_plan=None, kv_loc_cols=None,
        out_cache_loc_virtual=None)
    fields = {f.name for f in dataclasses.fields(fb)}
    if "num_token_non_padded_cpu" in fields:  # SGLang < 0.5.20's name of the count above
        new.update(num_token_non_padded_cpu=tokens,
                   num_token_non_padded=_count_like(fb.num_token_non_padded, tokens))
    out = dataclasses.replace(fb, **{k: v for k, v in new.items() if k in fields})
    translator = getattr(rows.mr, "kv_index_translator", None)
    if translator is not None:  # its write ids: the new out_cache_loc (SGLang's own binding)
        translator.bind_own_plan(out)
    return out


def _count_like(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else torch.tensor(n, dtype=t.dtype, device=t.device)
