"""DFLASH's decode-step preparation without its per-step host cost, for DFLASH_ADAPTIVE and
DFLASH_TREE (SGLang 0.5.16).

Before every decode step SGLang's scheduler calls `DFlashDraftInputV2.prepare_for_decode` on the
running batch's draft input: it reserves KV slots ahead (each request up to its committed length
+ 2 W, W the server's `speculative_num_draft_tokens`), sends the current and reserved lengths to
the device and allocates through `alloc_for_spec_decode`. The draft input is a new object every
step, so that method allocates its five length buffers again every step (two in pinned host
memory, two on the device), and it fills them element by element in a Python loop over the
requests. In the adaptive server's scheduler at the Qwen3-8B shape (H100, 64 requests,
2026-12-06 profile) it was 10.8 % of the samples, 1.5 ms per step (plain SGLang's whole
`prepare_for_decode`: 0.46 ms), 0.39 ms of it in the buffer allocation; in the fixture's q = 1
servers 21-29 % (H200, 2026-12-03). Where the host sets the pace (the 20M fixture) every such
millisecond is a millisecond of the step.

`prepare_for_decode` computes the same numbers from Python lists in one pass, makes the three
host tensors in one call each and sends the two length vectors to the device with asynchronous
copies from pageable memory (staged at once; nothing waits for the GPU, as `sglang_prefill`'s
`lengths_on`), then calls the same `alloc_for_spec_decode` with the same arguments, on the same
plan stream when SGLang uses one. The batch and the draft input end up with what DFLASH's method
leaves: `seq_lens_cpu` (int64), `seq_lens_sum`, `reserved_seq_lens_cpu` (int32),
`reserved_seq_lens_sum`, `max_top_k`, `uniform_top_k_value`.

Host time per call on an H100's host (`benchmarks/decode_prep_bench.py`, 2026-12-06): 107 / 142 /
214 us against DFLASH's 372 / 638 / 1,196 at 16 / 32 / 64 requests. Inside the fixture's
adaptive server on an H100 (2026-12-06 evening) `check` passed at 1 and 32 requests; alone, its
rows stayed within the spread of server starts (16-64 requests); with `DFLASH_PREFILL_APPEND`
(2026-12-06, night) the adaptive servers made 14-29 % more at 16, 32 and 64 requests than with
neither (two servers each way; BENCHMARKS.md "Host cuts"), hence on for DFLASH_ADAPTIVE.

`DFLASH_FAST_DECODE_PREP`: auto (default: DFLASH_ADAPTIVE's batches, where it was measured), 1
(DFLASH_TREE's too), 0 (DFLASH's own method everywhere), or `check` (both algorithms; every step
runs DFLASH's method and compares what it produced with this module's numbers; a difference
raises in the server). Installed as a HookRegistry AROUND hook on
`DFlashDraftInputV2.prepare_for_decode` unless 0; it routes only our algorithms' batches
(SGLang's DFLASH keeps its own).
"""

from __future__ import annotations

import os

import torch

from ..errors import env_choice

ENV = "DFLASH_FAST_DECODE_PREP"
TARGET = "sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2.prepare_for_decode"
OURS = ("DFLASH_ADAPTIVE", "DFLASH_TREE")
MODES = {"auto": ("DFLASH_ADAPTIVE",), "0": (), "1": OURS, "check": OURS}  # -> routed algorithms
_SETTLED: dict = {}


def mode(environ=os.environ) -> str:
    """`DFLASH_FAST_DECODE_PREP`: 'auto' (default), '1', '0' or 'check'; a `ConfigError`
    otherwise."""
    return env_choice(environ, ENV, "auto", tuple(MODES),
                      "DFLASH's decode-step preparation without its per-step buffers")


def plan(reqs, block_size: int) -> dict:
    """What DFLASH's method computes for `reqs` before it allocates: per request the committed,
    allocated and reserved lengths (reserved = max(allocated, committed + 2 W)), their sums,
    the tokens to allocate, and the batch's top-k summary."""
    committed = [int(r.kv_committed_len) for r in reqs]
    allocated = [int(r.kv.kv_allocated_len) for r in reqs]
    reserved = [max(a, c + 2 * block_size) for a, c in zip(allocated, committed)]
    top_k = [int(r.sampling_params.top_k) for r in reqs]
    return {"committed": committed, "allocated": allocated, "reserved": reserved,
            "needed": sum(reserved) - sum(allocated),
            "max_top_k": max([1, *top_k]),
            "uniform_top_k": top_k[0] if top_k and top_k.count(top_k[0]) == len(top_k) else None}


def server_block_size() -> int:
    """W as DFLASH's method reads it: the server args' `speculative_num_draft_tokens` (through
    the name its module calls)."""
    from sglang.srt.speculative import dflash_info_v2 as dv2

    w = int(dv2.get_server_args().speculative_num_draft_tokens)
    if w <= 0:
        raise ValueError(f"DFLASH invalid speculative_num_draft_tokens={w}.")
    return w


def prepare_for_decode(draft_input, batch) -> None:
    """DFLASH's `prepare_for_decode(batch)` on `draft_input` (module docstring)."""
    from sglang.srt.speculative import dflash_info_v2 as dv2

    reqs = batch.reqs
    if not reqs:
        return
    p = plan(reqs, server_block_size())
    cur_cpu = torch.tensor(p["allocated"], dtype=torch.int32)  # [bs]
    nxt_cpu = torch.tensor(p["reserved"], dtype=torch.int32)  # [bs]
    plan_stream, plan_ctx = dv2._get_overlap_plan_stream(batch.device)
    caller = None
    if plan_stream is not None:
        caller = torch.get_device_module(batch.device).current_stream()
    with plan_ctx:
        if plan_stream is not None:
            plan_stream.wait_stream(caller)  # the batch's tensors may be fresh on the caller
        dv2.alloc_for_spec_decode(
            batch.tree_cache, batch.req_to_token_pool, reqs=reqs,
            req_pool_indices=batch.req_pool_indices,
            cur_kv_lens=cur_cpu.to(batch.device, non_blocking=True), cur_kv_lens_cpu=cur_cpu,
            nxt_kv_lens=nxt_cpu.to(batch.device, non_blocking=True), nxt_kv_lens_cpu=nxt_cpu,
            num_needed_tokens=p["needed"], batch=batch)
    if caller is not None:
        caller.wait_stream(plan_stream)
    draft_input.max_top_k, draft_input.uniform_top_k_value = p["max_top_k"], p["uniform_top_k"]
    batch.seq_lens_cpu = torch.tensor(p["committed"], dtype=torch.int64)
    batch.seq_lens_sum = sum(p["committed"])
    draft_input.reserved_seq_lens_cpu = nxt_cpu
    draft_input.reserved_seq_lens_sum = sum(p["reserved"])


def check(original, draft_input, batch) -> None:
    """DFLASH's method, then a comparison with `plan` (raises on a difference)."""
    p = plan(batch.reqs, server_block_size()) if batch.reqs else None
    original(draft_input, batch)
    if p is None:
        return
    got = {"committed": batch.seq_lens_cpu.tolist(), "seq_lens_sum": batch.seq_lens_sum,
           "reserved": draft_input.reserved_seq_lens_cpu.tolist(),
           "reserved_sum": draft_input.reserved_seq_lens_sum,
           "max_top_k": draft_input.max_top_k, "uniform_top_k": draft_input.uniform_top_k_value}
    want = {"committed": p["committed"], "seq_lens_sum": sum(p["committed"]),
            "reserved": p["reserved"], "reserved_sum": sum(p["reserved"]),
            "max_top_k": p["max_top_k"], "uniform_top_k": p["uniform_top_k"]}
    bad = [k for k in want if got[k] != want[k]]
    if bad:
        raise RuntimeError(f"{ENV}=check: DFLASH's prepare_for_decode differs in {bad}: "
                           f"{ {k: got[k] for k in bad} } against { {k: want[k] for k in bad} }")


def _is_ours(batch) -> bool:
    name = getattr(getattr(batch, "spec_algorithm", None), "name", None)
    return name in MODES[_SETTLED.get("mode", "0")]


def around_prepare(original, draft_input, batch):
    """The AROUND hook: our algorithms' batches by `DFLASH_FAST_DECODE_PREP`, others DFLASH's."""
    if not _is_ours(batch):
        return original(draft_input, batch)
    if _SETTLED.get("mode") == "check":
        return check(original, draft_input, batch)
    return prepare_for_decode(draft_input, batch)


def register_hook() -> bool:
    """Install the AROUND hook once unless `DFLASH_FAST_DECODE_PREP` is 0 (HookRegistry applies
    it in `load_plugins`); True when it is installed."""
    _SETTLED["mode"] = mode()
    if _SETTLED["mode"] == "0":
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(h is around_prepare for _, h, _ in HookRegistry._hooks.get(TARGET, [])):
        HookRegistry.register(TARGET, around_prepare, HookType.AROUND)
    return True
