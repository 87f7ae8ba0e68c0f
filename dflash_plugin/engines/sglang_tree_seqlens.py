"""DFLASH_TREE's host copy of the committed sequence lengths, read late in the round. Opt-in
(`DFLASH_TREE_LATE_SEQ_LENS=1`, `DFLASH_TREE_LATE_SEQ_LENS_CHECK=1` to compare every read with
the device lengths, syncing); written against SGLang 0.5.16, not yet run on a GPU.

Why: SGLang 0.5.16's overlap scheduler gives a decode batch `seq_lens_cpu` only when some
attention backend of the speculative forward asks for it (`decide_needs_cpu_seq_lens`, OR of
`needs_cpu_seq_lens` over the worker's `spec_v2_attn_backends`). flashinfer asks, and the tree
verifies through flashinfer (custom masks), so every round starts with
`FutureMap.resolve_seq_lens_cpu` waiting for the previous round's verify (H200, Qwen3-8B shape,
2026-12-04: 1.7-2.2 ms of host wait per round, and the GPU idles while the host then prepares and
launches the drafter: a 32-node round is 8.76 ms against 7.75 ms of kernels). Only the tree
verify needs the lengths on the host (the fa3 drafter does not: DFLASH on fa3 runs without
them). So the worker leaves the target backend out of `spec_v2_attn_backends`, keeps its own
host mirror of every request's committed length (`SeqLensMirror`: device lengths by req-pool
slot, copied to pinned host memory after each publish, an event recorded after each copy) and
reads it after the drafter and the tree phase are queued, when the previous verify has long
finished.
"""

from __future__ import annotations

import os

import torch


class SeqLensMirror:
    """Committed length of every request-pool slot, on the device and (copied asynchronously
    after each `publish`) on the host. `read` waits for the last copy only."""

    def __init__(self, slots: int, device: torch.device | str):
        device = torch.device(device)
        self.device = device
        self.dev = torch.zeros(slots, dtype=torch.int64, device=device)  # [slots]
        cuda = device.type == "cuda"
        self.host = torch.zeros(slots, dtype=torch.int64, pin_memory=cuda)  # [slots]
        self.event = torch.cuda.Event() if cuda else None  # re-recorded after each copy

    def publish(self, req_pool_indices: torch.Tensor, new_seq_lens: torch.Tensor) -> None:
        """After a forward that committed `new_seq_lens` `[bs]` for the requests in slots
        `req_pool_indices` `[bs]` (device tensors, same stream as the forward)."""
        if req_pool_indices.numel() == 0:
            return
        self.dev[req_pool_indices.long()] = new_seq_lens.to(torch.int64)
        self.host.copy_(self.dev, non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()

    def read(self, req_pool_indices_cpu: torch.Tensor) -> torch.Tensor:
        """Host lengths `[bs]` (int64) of the slots `req_pool_indices_cpu` (host), as of the
        last publish."""
        if self.event is not None:
            self.event.synchronize()  # returns at once before the first record
        return self.host[req_pool_indices_cpu.long()]  # indexing copies


def late_seq_lens_from_env() -> tuple[bool, bool]:
    """(on, check) from `DFLASH_TREE_LATE_SEQ_LENS` / `..._CHECK` (both off by default)."""
    on = os.environ.get("DFLASH_TREE_LATE_SEQ_LENS", "0") == "1"
    return on, on and os.environ.get("DFLASH_TREE_LATE_SEQ_LENS_CHECK", "0") == "1"


def check_against_device(host: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """`..._CHECK=1`: the mirror's lengths equal the batch's device lengths (a host sync);
    raises on a difference."""
    dev = seq_lens.to("cpu", torch.int64)
    if not torch.equal(dev, host.to(torch.int64)):
        raise RuntimeError(f"DFLASH_TREE late seq lens: mirror {host.tolist()} != device "
                           f"{dev.tolist()}")


def give_host_lens(batch, mirror: SeqLensMirror, check: bool = False) -> None:
    """Set the batch's `seq_lens_cpu` / `seq_lens_sum` from `mirror` (its slots:
    `batch.req_pool_indices_cpu`); with `check`, compared with the device lengths first."""
    lens = mirror.read(batch.req_pool_indices_cpu)
    if check:
        check_against_device(lens, batch.seq_lens)
    batch.seq_lens_cpu, batch.seq_lens_sum = lens, int(lens.sum())


def wrap_publish(on_publish, mirror: SeqLensMirror, req_pool_indices: torch.Tensor):
    """`on_publish` (SGLang's, may be None) that also records the lengths in `mirror`."""

    def publish(new_seq_lens):
        if on_publish is not None:
            on_publish(new_seq_lens)
        mirror.publish(req_pool_indices, new_seq_lens)

    return publish
