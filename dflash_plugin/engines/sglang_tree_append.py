"""The drafter-KV append of a DFLASH_TREE round, one CUDA graph per batch bucket (no SGLang
import here).

After SGLang's tree verify has compacted the accepted path to the front of each request's
verify block, the drafter's K/V of that path are written from the target's hidden states by
DFLASH's own `_append_target_hidden_to_draft_kv_by_loc` (projection, norm, RoPE and a
prefix-valid write into every drafter layer; `append_fn` here). Eager, its launches took 1.2 ms
of host time per round on the H200 at the fixture size, as much as its GPU time
(`DFLASH_TREE_PROFILE`, 2026-12-02). Its shapes depend on the batch size only, so
`AppendStage` replays one graph per batch bucket (`sglang_buckets.BucketGraphs`). A padded row
commits 0 tokens: the prefix-valid write leaves its slots alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .sglang_buckets import BucketGraphs, bucket_limit, warm_buckets


def accepted_path(hidden: torch.Tensor, verify_cache_loc: torch.Tensor, prefix: torch.Tensor,
                  commit: torch.Tensor, width: int, depth1: int):
    """The accepted path's rows after SGLang's tree compaction: the first `depth1` (= D + 1)
    rows of each request's verify block (hidden states `[bs * W, h]`, slots `verify_cache_loc`
    `[bs * W]` = the verify's `out_cache_loc`, i.e. `req_to_token[prefix : prefix + W]`) at
    positions prefix + 0..D, and the commit lengths (accepted drafts + bonus) that bound the
    prefix-valid write. Returns hidden `[bs, D+1, h]`, slots and positions `[bs, D+1]` (int64),
    commit `[bs]` (int32)."""
    bs = int(prefix.shape[0])
    hid = hidden.view(bs, width, -1)[:, :depth1]
    loc = verify_cache_loc.view(bs, width)[:, :depth1].to(torch.int64)
    pos = prefix.to(torch.int64)[:, None] + torch.arange(depth1, device=prefix.device)
    return hid, loc, pos, commit.to(torch.int32)


def fused_workspaces(worker) -> list:
    """What a captured append reads but DFLASH's fused-KV helper may replace later (its
    workspaces grow on a larger prefill; 0.5.16 `fused_kv_materialize.py`)."""
    h = getattr(worker, "_fused_kv_helper", None)
    if h is None:
        return []
    rope = getattr(getattr(h, "rotary_emb", None), "cos_sin_cache", None)
    return [getattr(h, a, None) for a in ("_proj_workspace", "_k_workspace",
                                          "_v_workspace")] + [rope]


def append_kwargs(hid: torch.Tensor, loc: torch.Tensor, pos: torch.Tensor,
                  commit: torch.Tensor) -> dict:
    """DFLASH's `_append_target_hidden_to_draft_kv_by_loc` keywords from `accepted_path`'s
    tensors (or their bucket's buffers)."""
    return dict(target_hidden=hid.reshape(-1, hid.shape[-1]), cache_loc=loc.reshape(-1),
                cache_loc_2d=loc, positions=pos.reshape(-1), commit_lens=commit)


def drafter_input(worker) -> tuple[int, int, torch.dtype] | None:
    """A DFLASH worker's running-request limit (`bucket_limit` of its server args) and what its
    drafter's `fc` projects (the target hidden width and dtype); None when either is unknown."""
    limit = bucket_limit(worker.server_args)
    fc = getattr(worker.draft_model, "fc", None)
    if not limit or fc is None:
        return None
    return limit, int(fc.in_features), fc.weight.dtype


class AppendStage:
    """`run(hid, loc, pos, commit)` (`accepted_path`'s tensors) calls `append_fn(**kwargs)` over
    the batch's bucket; `keep()` names the workspaces `append_fn` uses but may reallocate later
    (DFLASH's fused-KV helper grows its own on a larger prefill)."""

    def __init__(self, device: torch.device, append_fn: Callable[..., None],
                 graphs: bool = True, keep: Callable[[], Sequence[torch.Tensor]] | None = None):
        self.device, self.append_fn = device, append_fn
        self.graphs = BucketGraphs(device, "append", graphs, keep)

    def warm(self, max_bs: int, depth1: int, hidden_size: int, dtype: torch.dtype) -> list[int]:
        """Capture the buckets of `warm_buckets(max_bs)` now (graphs on; else nothing) with
        commit lengths of 0 (nothing is written): returns the buckets captured."""
        if not self.graphs.enabled:
            return []
        sizes = warm_buckets(max_bs)
        self.graphs.reserve(sizes[-1])  # one set of input buffers for every bucket
        for pad in sizes:
            z = torch.zeros(pad, depth1, dtype=torch.int64, device=self.device)
            self.run(torch.zeros(pad, depth1, hidden_size, dtype=dtype, device=self.device),
                     z, z, torch.zeros(pad, dtype=torch.int32, device=self.device))
        return sizes if self.graphs.enabled else []

    def warm_for(self, worker, depth1: int) -> list[int]:
        """`warm` for a DFLASH worker (`drafter_input`); [] when that is unknown (buckets are
        then captured on first use)."""
        known = drafter_input(worker)
        return [] if known is None else self.warm(known[0], depth1, *known[1:])

    def run(self, hid: torch.Tensor,  # [bs, D+1, h] the accepted path's target hidden states
            loc: torch.Tensor,  # [bs, D+1] int64 their KV slots
            pos: torch.Tensor,  # [bs, D+1] int64 their positions
            commit: torch.Tensor,  # [bs] int32 rows to write per request (accepted + bonus)
            ) -> None:
        bs = int(hid.shape[0])
        pad, (h, lo, po, co) = self.graphs.load((hid, loc, pos, commit))
        co[bs:].zero_()  # rows past the batch write nothing

        def phase() -> None:
            self.append_fn(**append_kwargs(h, lo, po, co))

        self.graphs.run(pad, phase)
