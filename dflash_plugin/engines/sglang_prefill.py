"""A DFLASH prefill that does not wait for the GPU: DFLASH_ADAPTIVE's and DFLASH_TREE's prefill
(extend) step, SGLang 0.5.16's `DFlashWorkerV2.forward_batch_generation` extend branch without
its host sync.

That branch builds the prompt lengths on the device with `torch.tensor(list, device=cuda)`, a
blocking copy: PyTorch synchronizes the stream after it, so the scheduler's thread waits there
until the GPU has run everything queued, the target's whole prefill included. Plain SGLang
launches a prefill and goes on preparing the next batch while the GPU runs it (overlap
scheduling); DFLASH's worker cannot, and after each prefill the GPU idles while the host
prepares the next step. `tests/engines/test_sglang_prefill.py` shows the sync on a GPU (CUDA's
sync debug mode) and that `prefill` has none.

Measured (H100, SGLang 0.5.16, Qwen3-8B shape, 2026-12-06, BENCHMARKS.md): no change in the rows
of `benchmarks/gpu_adaptive_sglang.py` (adaptive 1,875 / 3,873 tok/s at 16 / 64 requests with it,
1,876 / 3,872 without; with it, the greedy outputs equal plain's on 16 / 16 prompts), whose
requests all generate 128 tokens and so arrive in a few waves, a few prefills per row. With
outputs of 64-192 tokens (`--length-spread 0.5`: a request finishes and one is prefilled every
few steps, as in serving) it was worth +2.1 / +1.9 %: adaptive 1,559 / 4,244 tok/s with it,
1,527 / 4,166 without, plain 1,597 / 4,169 (H100, same afternoon). On by default: it removes a
wait and changes no output (greedy outputs equal plain's, 16 / 16, both ways).

`prefill` does the same work in the same stream order: the target's prefill capturing DFLASH's
hidden states, the prompt's rows appended to the drafter's KV at the prompt's slots (the
worker's own `_append_target_hidden_to_draft_kv_by_loc`), the next draft input; the lengths
reach the device through an asynchronous copy (pageable memory is staged at once; nothing waits
for the GPU), as SGLang's `ForwardBatch.init_new` sends its own. `DFLASH_ASYNC_PREFILL=0` keeps
DFLASH's branch (for A/B runs).
"""

from __future__ import annotations

import os

import torch

from ..errors import env_flag

ENV = "DFLASH_ASYNC_PREFILL"


def enabled(environ=os.environ) -> bool:
    """`DFLASH_ASYNC_PREFILL`: 1 (default) or 0; a `ConfigError` otherwise."""
    return env_flag(environ, ENV, "1", "DFLASH prefills without a host sync")


def lengths_on(lens, device) -> torch.Tensor:
    """A host list of lengths as an int32 device tensor, copied without waiting for the GPU
    ([n]; the copy is ordered after the stream's earlier work)."""
    return torch.tensor(lens, dtype=torch.int32).to(device, non_blocking=True)


def prefill(worker, batch, on_publish=None):
    """The extend step of `worker` (a `DFlashWorkerV2`) for `batch`: the target's prefill with
    DFLASH's hidden states captured, the prompt tokens' drafter KV written, the next draft
    input; no host sync (module docstring). Returns SGLang's `GenerationBatchResult`."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, compute_position

    if getattr(batch, "return_logprob", False):
        raise ValueError("DFLASH speculative decoding does not support return_logprob yet.")
    worker._validate_phase1_sampling_support(batch)
    out = worker.target_worker.forward_batch_generation(
        batch, capture_hidden_mode=CaptureHiddenMode.FULL)
    logits, next_ids = out.logits_output, out.next_token_ids
    out.new_seq_lens = batch.seq_lens
    if on_publish is not None:
        on_publish(out.new_seq_lens)
    if logits.hidden_states is None:
        raise RuntimeError("DFLASH needs the target's captured hidden states at prefill; the "
                           "target model has no DFlash layers to capture configured")
    if batch.extend_lens is None or batch.prefix_lens is None or batch.out_cache_loc is None:
        raise RuntimeError("DFLASH prefill expects extend_lens, prefix_lens and out_cache_loc")
    device = next_ids.device
    positions, _ = compute_position(  # [sum(extend_lens)] each prompt token's position
        worker.model_runner.server_args.attention_backend,
        lengths_on(batch.prefix_lens, device), lengths_on(batch.extend_lens, device),
        int(sum(batch.extend_lens)))
    # the prompt's drafter KV now, in stream order (the radix cache may share these slots)
    worker._append_target_hidden_to_draft_kv_by_loc(
        target_hidden=logits.hidden_states, cache_loc=batch.out_cache_loc, positions=positions)
    logits.hidden_states = None  # not copied to the host
    out.next_draft_input = worker._make_next_draft_input_prefill(
        bonus_tokens=next_ids, seq_lens=batch.seq_lens)
    return out
