"""DFLASH_TREE's verify with the greedy acceptance in one CUDA graph (`DFLASH_TREE_FAST_ACCEPT`).

`verify_fast` is SGLang 0.5.16's `run_eagle_verify` up to the target's forward (the same
`eagle_prepare_for_verify`, stream records and `forward_batch_generation`), then the target's
argmax and `sglang_tree_accept.AcceptStage` (walk, SGLang's outputs, target-KV move, drafter-KV
append) in place of `eagle_sample`, `fill_bonus_tokens` and `_finalize_accept_tree_path`. A
round takes it only when SGLang's greedy branch would do nothing else. What sends a round back
to `run_eagle_verify`: sampling, a grammar, penalties or a logit bias (`round_slow_reason`, each
round), SGLang's simulated acceptance, a hybrid model's state commits, a pool that clears
unaccepted states (`server_slow_reason`, once at start-up); `slow_reason` is both.

`DFLASH_TREE_FAST_ACCEPT`: 0 (default: SGLang's path every round), 1, or `check` (each fast
round also runs SGLang's `eagle_sample` on the same logits, which writes no cache, and raises
on a different acceptance length or accepted token).
"""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError
from .sglang_tree_accept import Accepted, AcceptStage

ENV = "DFLASH_TREE_FAST_ACCEPT"


def fast_accept_from_env(environ=os.environ) -> tuple[bool, bool]:
    """(on, check) from `DFLASH_TREE_FAST_ACCEPT` (0, 1 or check); a clear error otherwise."""
    raw = environ.get(ENV, "0").strip().lower() or "0"
    if raw not in ("0", "1", "check"):
        raise ConfigError(ENV, f"must be 0, 1 or check (greedy acceptance in one CUDA graph), "
                               f"got {raw!r}")
    return raw != "0", raw == "check"


def round_slow_reason(batch) -> str | None:
    """What in this round's batch sends it to SGLang's `run_eagle_verify` (None: nothing)."""
    info = batch.sampling_info
    if info is None or not info.is_all_greedy:
        return "sampling"
    if batch.has_grammar:
        return "grammar"
    if any(getattr(info, a, None) is not None
           for a in ("acc_additive_penalties", "acc_scaling_penalties", "logit_bias")):
        return "penalties or logit bias"
    return None


def server_slow_reason(target_worker, kvcache) -> str | None:
    """What sends every round of this server to `run_eagle_verify` (None: nothing); it does not
    change while the server runs, so the worker asks once."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.speculative.spec_utils import SIMULATE_ACC_LEN

    if SIMULATE_ACC_LEN > 0:
        return "simulated acceptance"
    if getattr(kvcache, "clear_unaccepted_c128_draft_states", None) is not None:
        return "the pool clears unaccepted draft states"
    if mambaish_config(target_worker.model_runner.model_config) is not None:
        return "hybrid-model state commit"
    return None


def slow_reason(batch, target_worker, kvcache) -> str | None:
    """Why this decode round must take SGLang's `run_eagle_verify` (None: it need not)."""
    return round_slow_reason(batch) or server_slow_reason(target_worker, kvcache)


def verify_fast(batch, *, target_worker, req_to_token_pool, stage: AcceptStage, tree,
                prefix: torch.Tensor, device, check: bool = False):
    """-> (SGLang's `GenerationBatchResult` with next_token_ids / accept_lens / new_seq_lens
    set as its greedy path sets them, `Accepted`). The target KV of the accepted path is at the
    front of each verify block and its drafter KV appended when this returns (queued)."""
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.eagle_utils import eagle_prepare_for_verify
    from sglang.srt.speculative.spec_utils import record_stream_each, record_stream_for_v2_verify
    from sglang.srt.utils.async_probe import sanitize_nan_logits

    fwd_stream = torch.get_device_module(device).current_stream()
    verify_input = batch.spec_info
    record_stream_for_v2_verify(batch, verify_input, fwd_stream)
    fb, can_graph = eagle_prepare_for_verify(verify_input, req_to_token_pool, batch,
                                             target_worker)
    record_stream_each((batch.input_ids, batch.out_cache_loc), fwd_stream)
    out = target_worker.forward_batch_generation(batch=None, forward_batch=fb, is_verify=True)
    logits = out.logits_output
    sanitize_nan_logits(logits.next_token_logits, "verify: target model logits")
    bs, w = len(batch.seq_lens), verify_input.draft_token_num
    choice = torch.argmax(logits.next_token_logits, dim=-1).view(bs, w)
    if check:
        want = sglang_greedy(verify_input, batch, logits)
    if logits.hidden_states is None:
        raise RuntimeError("DFLASH_TREE: the verify returned no target hidden states")
    acc = stage.run(choice, tree, batch.out_cache_loc, logits.hidden_states, prefix)
    logits.hidden_states = None
    if check:
        compare(acc, *want, w)
    result = GenerationBatchResult(
        logits_output=logits, next_token_ids=acc.predict, can_run_cuda_graph=can_graph,
        speculative_num_draft_tokens=w, next_draft_input=None, accept_lens=acc.accept_lens,
        new_seq_lens=acc.new_seq_lens, routed_experts_output=out.routed_experts_output,
        indexer_topk_output=out.indexer_topk_output, extra_keep_alive_refs=[fb])
    return result, acc


def republish_read_done(model_runner, device) -> None:
    """Move the target runner's WAR read-done event to *now* (after SGLang's tree compaction).

    0.5.16's scheduler (`_apply_war_barrier`, `managers/scheduler.py`) lets its next shared-buffer
    writes wait only on `model_worker.war_fastpath_runner.war_fastpath_read_done_event`; for a
    DFLASH-family TARGET_VERIFY graph the target runner records it *before* replay
    (`decode_cuda_graph_runner.py` `execute`: DFLASH reads no shared buffer after its verify). Our
    verify then runs EAGLE's `move_accept_tokens_to_target_kvcache`, which reads `req_to_token`
    after the replay, so the event is re-recorded here. Without an event (eager verify) the
    scheduler waits on the whole forward stream: nothing to do. (Inferred from code; GPU-check.)"""
    if getattr(model_runner, "war_fastpath_read_done_event", None) is None:
        return
    event = torch.get_device_module(device).Event()
    event.record()
    model_runner.war_fastpath_read_done_event = event


def sglang_greedy(verify_input, batch, logits):
    """SGLang's own greedy acceptance of these logits (`eagle_sample`; no cache written)."""
    from sglang.srt.speculative.eagle_utils import eagle_sample

    predict, accept_lens, accept_index = eagle_sample(verify_input, batch, logits, None)
    return predict, accept_lens, accept_index


def compare(acc: Accepted, predict, accept_lens, accept_index, width: int) -> None:
    """Raise unless `acc` accepts what SGLang's `eagle_sample` accepted (host sync: checks)."""
    n = accept_lens.tolist()
    if acc.accept_lens.tolist() != n:
        raise RuntimeError(f"{ENV}=check: accept lengths {acc.accept_lens.tolist()} != "
                           f"SGLang's {n}")
    ours = acc.predict.view(-1, width).tolist()
    for b, k in enumerate(n):
        theirs = predict[accept_index[b, :k].long()].tolist()
        if ours[b][:k] != theirs:
            raise RuntimeError(f"{ENV}=check: request {b} accepted "
                               f"{ours[b][:k]}, SGLang {theirs}")
