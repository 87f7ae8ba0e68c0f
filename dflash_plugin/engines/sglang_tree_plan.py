"""DFLASH_TREE's tree-verify attention plan without a host sync. On by default
(`DFLASH_TREE_HOST_PLAN=0`: flashinfer's own plan; `DFLASH_TREE_HOST_PLAN_CHECK=1` compares every
replay's layout and packed mask with flashinfer's own, syncing); written against SGLang 0.5.16 +
flashinfer 0.6.14. Ran on the H200 (2026-12-04): the check passed at 1 and 4 requests, outputs
lossless, a 32-node round at the Qwen3-8B shape 9.89 -> 9.23 ms (8.76 ms with the fa3 drafter).

Before every replay of a TARGET_VERIFY CUDA graph, SGLang 0.5.16's flashinfer backend calls the
graph's prefill wrapper's `begin_forward` (flashinfer's `BatchPrefillWithPagedKVCacheWrapper.plan`,
`flashinfer_backend.py` `call_begin_forward`). That plan copies `qo_indptr` and `kv_indptr` to the
host and packs the custom mask with `segment_packbits`, whose output size is an `.item()`: each a
blocking copy that waits for every kernel queued before it (the drafter and the tree phase).
SGLang's own sync-free `fast_prefill_plan` serves EAGLE's draft-extend graphs only and takes no
custom mask. A tree verify's sizes are all known on the host: W query rows per request and
seq_len + W keys (`seq_lens_cpu`, which SGLang's fa3 verify metadata also reads; padded graph
rows: the runner's fill value). So `tree_verify_plan` packs the mask on the device into the
wrapper's mask buffer with host-known sizes (`pack_mask_bits`) and hands the rest to SGLang's
`fast_prefill_plan` with the host layout (`host_layout`). Without a layout for the replay (no
`seq_lens_cpu`, a batch larger than the graph's) it calls the wrapper's own plan.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


def host_layout(seq_lens: list[int], padded_bs: int, fill: int, width: int):
    """(qo_indptr, kv_indptr, kv_lens) as host int32 tensors of a tree verify of `padded_bs`
    rows: row i has `width` query rows and seq_lens[i] + width keys; rows past len(seq_lens)
    (graph padding) have `fill` + width keys. Page size 1."""
    if len(seq_lens) > padded_bs:
        raise ValueError(f"{len(seq_lens)} requests do not fit a graph of {padded_bs} rows")
    kv = torch.tensor([int(s) + width for s in seq_lens]
                      + [fill + width] * (padded_bs - len(seq_lens)), dtype=torch.int32)
    qo = torch.arange(0, (padded_bs + 1) * width, width, dtype=torch.int32)
    kv_indptr = torch.zeros(padded_bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(kv, 0)
    return qo, kv_indptr, kv


def mask_indptrs(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                 last_page_len: torch.Tensor, page_size: int = 1):
    """Bit and byte offsets `[bs + 1]` of each request's mask segment (q_len x kv_len bits,
    packed to ceil(bits / 8) bytes), on the tensors' device, without a host read."""
    q = (qo_indptr[1:] - qo_indptr[:-1]).long()
    kv = ((kv_indptr[1:] - kv_indptr[:-1] - 1) * page_size + last_page_len).long()
    bits, zero = q * kv, q.new_zeros(1)
    return (torch.cat([zero, torch.cumsum(bits, 0)]),
            torch.cat([zero, torch.cumsum((bits + 7) // 8, 0)]))


def pack_mask_bits(mask: torch.Tensor, bit_indptr: torch.Tensor, byte_indptr: torch.Tensor,
                   n_bits: int, n_bytes: int, out: torch.Tensor) -> torch.Tensor:
    """`numpy.packbits(segment, bitorder="little")` of every segment of `mask` (`[>= n_bits]`
    bool / uint8; segment i = mask[bit_indptr[i]:bit_indptr[i + 1]]) into `out[:n_bytes]`
    (uint8), segments starting at byte_indptr[i]: flashinfer's `segment_packbits(...,
    bitorder="little")` with the sizes given by the host instead of read back."""
    idx = torch.arange(n_bits, device=mask.device)  # [n_bits] global bit index
    seg = torch.searchsorted(bit_indptr[1:].contiguous().long(), idx, right=True)
    local = idx - bit_indptr.long()[seg]  # bit index inside its segment
    byte = byte_indptr.long()[seg] + local // 8
    val = mask[:n_bits].to(torch.int32) << (local % 8).to(torch.int32)
    acc = torch.zeros(n_bytes, dtype=torch.int32, device=mask.device)
    acc.index_add_(0, byte, val)
    out[:n_bytes].copy_(acc)
    return out[:n_bytes]


@dataclass
class PlanLayout:
    """What the worker knows about the coming verify replay: its host sequence lengths (None:
    unknown, the wrapper's own plan runs), W, and the graph runner's fill value for padding."""

    width: int
    fill: int = 1
    seq_lens_cpu: torch.Tensor | None = None
    check: bool = False


def layout_from_env(width: int) -> PlanLayout | None:
    """The worker's layout (checked with `DFLASH_TREE_HOST_PLAN_CHECK=1`), or None (flashinfer's
    own plan) with `DFLASH_TREE_HOST_PLAN=0`."""
    if os.environ.get("DFLASH_TREE_HOST_PLAN", "1") == "0":
        return None
    return PlanLayout(width, check=os.environ.get("DFLASH_TREE_HOST_PLAN_CHECK", "0") == "1")


def tree_verify_plan(wrapper, qo_indptr, paged_kv_indptr, paged_kv_indices,
                     paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
                     *args, layout: PlanLayout, fast_plan, own_plan, custom_mask=None, **kw):
    """The wrapper's `begin_forward` for tree-verify graph replays (see the module): SGLang's
    `fast_plan` (`fast_prefill_plan`) with the host layout, and the custom mask packed into the
    wrapper's graph mask buffers; `own_plan` (the wrapper's plan) when the layout is unknown."""
    bs = int(paged_kv_last_page_len.shape[0])
    lens = layout.seq_lens_cpu
    if custom_mask is None or lens is None or len(lens) > bs or page_size != 1:
        return own_plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                        num_qo_heads, num_kv_heads, head_dim_qk, page_size, *args,
                        custom_mask=custom_mask, **kw)
    qo_h, kv_indptr_h, kv_h = host_layout(lens.tolist(), bs, layout.fill, layout.width)
    fast_plan(wrapper, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
              num_qo_heads, num_kv_heads, head_dim_qk, page_size, *args, **kw,
              qo_indptr_host=qo_h, kv_indptr_host=kv_indptr_h, kv_lens_host=kv_h,
              max_q_len=layout.width, max_kv_len=int(kv_h.max()))
    bit_ptr, byte_ptr = mask_indptrs(qo_indptr, paged_kv_indptr, paged_kv_last_page_len)
    bits = layout.width * kv_h.long()  # [bs] mask bits per request (host)
    n_bits, n_bytes = int(bits.sum()), int(((bits + 7) // 8).sum())
    # the reference first: SGLang's graph mask buffer (the bool mask) is the wrapper's packed
    # buffer too (`cuda_graph_custom_mask`, `_create_prefill_wrappers`), packed over in place
    want = reference_pack(custom_mask, bit_ptr) if layout.check else None
    packed = pack_mask_bits(custom_mask.reshape(-1), bit_ptr, byte_ptr, n_bits, n_bytes,
                            wrapper._custom_mask_buf)
    wrapper._mask_indptr_buf.copy_(byte_ptr.to(wrapper._mask_indptr_buf.dtype),
                                   non_blocking=True)
    if layout.check:
        check_layout(paged_kv_indptr, kv_indptr_h, packed, want)
    return None


def reference_pack(custom_mask, bit_ptr) -> torch.Tensor:
    """flashinfer's own packing of the mask (`segment_packbits`, host sync)."""
    from flashinfer.quantization import segment_packbits

    flat = custom_mask.reshape(-1)[: int(bit_ptr[-1])].bool()
    return segment_packbits(flat, bit_ptr.to(torch.int32), bitorder="little")[0]


def check_layout(kv_indptr, kv_indptr_host, packed, want) -> None:
    """`DFLASH_TREE_HOST_PLAN_CHECK=1`: the host layout equals the device's and the packed mask
    equals flashinfer's (host syncs; raises on a difference)."""
    dev = kv_indptr.cpu()
    if not torch.equal(dev, kv_indptr_host):
        raise RuntimeError(f"DFLASH_TREE host plan: kv_indptr {dev.tolist()} on the device, "
                           f"{kv_indptr_host.tolist()} from seq_lens_cpu")
    if not torch.equal(want, packed):
        raise RuntimeError("DFLASH_TREE host plan: packed mask differs from segment_packbits")


def install(attn_backend, layout: PlanLayout) -> int:
    """Give every TARGET_VERIFY graph wrapper of a flashinfer backend (its
    `prefill_cuda_graph_metadata`, filled at capture) `tree_verify_plan` as `begin_forward`,
    as SGLang does with `fast_prefill_plan` for its draft-extend graphs; returns how many.
    Backends without those wrappers (Triton): 0."""
    from sglang.srt.layers.attention.flashinfer_backend import fast_prefill_plan

    n = 0
    for wrappers in getattr(attn_backend, "prefill_cuda_graph_metadata", {}).values():
        for w in wrappers:
            if getattr(w.begin_forward, "func", None) is tree_verify_plan:
                continue
            masked = getattr(w, "_custom_mask_buf", None) is not None
            if getattr(w, "_backend", None) != "fa2" or not masked:
                continue  # fast_prefill_plan supports fa2 only; no mask: not a tree graph
            w.begin_forward = functools.partial(tree_verify_plan, w, layout=layout,
                                                fast_plan=fast_prefill_plan,
                                                own_plan=w.begin_forward)
            n += 1
    return n
