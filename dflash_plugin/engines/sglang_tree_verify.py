"""DFLASH_TREE's verify with the acceptance in one CUDA graph (`DFLASH_TREE_FAST_ACCEPT`).

`verify_fast` is SGLang 0.5.16's `run_eagle_verify` up to the target's forward (the same
`eagle_prepare_for_verify`, stream records and `forward_batch_generation`), then the target's
token at every tree node (`target_choice`) and `sglang_tree_accept.AcceptStage` (walk, SGLang's
outputs, target-KV move, drafter-KV append) in place of `eagle_sample`, `fill_bonus_tokens` and
`_finalize_accept_tree_path`.

The node's token is the argmax at T = 0. At T > 0 it is one sample of softmax(logits / T)
(`specdec_kernels.sampling.race_sample`; rows with top-k 1 take the argmax, as SGLang's
top-k renorm leaves them), and the walk follows the child that carries the sample: each emitted
token is then a sample of the target's distribution given the tokens before it, which is what
SGLang's target-only tree sampling (`tree_speculative_sampling_target_only`, one coin per
depth over the children's cumulative mass, the bonus from the residual) gives in distribution
too; the random numbers differ.

A round takes the fast path only when SGLang's branch would do nothing else. What sends a
round back to `run_eagle_verify`: a grammar, penalties or a logit bias; at T > 0 also top-p,
min-p or a top-k other than 1 or all (`round_slow_reason`, each round); SGLang's simulated
acceptance, a hybrid model's state commits, a pool that clears unaccepted states
(`server_slow_reason`, once at start-up); at T > 0 also rejection sampling with draft
probabilities, acceptance thresholds below 1, or more than one rank (`sampling_slow_reason`,
once: then every T > 0 round takes SGLang's path). `slow_reason` is the greedy pair.

`DFLASH_TREE_FAST_ACCEPT`: 0 (default: SGLang's path every round), 1, or `check` (each fast
round also runs SGLang's acceptance on the same logits, which writes no cache, and raises on a
different acceptance length or accepted token: at T = 0 `eagle_sample`, at T > 0 SGLang's tree
walk, `verify_tree_greedy_func`, fed the same sampled tokens).
"""
from __future__ import annotations

import os

import torch
from specdec_kernels.sampling import race_sample

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


def round_slow_reason(batch, sampling: bool = False) -> str | None:
    """What in this round's batch sends it to SGLang's `run_eagle_verify` (None: nothing);
    `sampling`: T > 0 rounds may take the fast path (`sampling_slow_reason` found nothing)."""
    info = batch.sampling_info
    if info is None:
        return "sampling"
    if not info.is_all_greedy:
        if not sampling:
            return "sampling"
        if info.need_top_p_sampling or info.need_min_p_sampling:
            return "top-p or min-p sampling"
        if info.need_top_k_sampling and any(
                1 < r.sampling_params.top_k < info.vocab_size for r in batch.reqs):
            return "top-k sampling"
    if batch.has_grammar:
        return "grammar"
    if any(getattr(info, a, None) is not None
           for a in ("acc_additive_penalties", "acc_scaling_penalties", "logit_bias")):
        return "penalties or logit bias"
    return None


def sampling_slow_reason(server_args) -> str | None:
    """What sends every T > 0 round of this server to `run_eagle_verify` (None: nothing):
    SGLang's acceptance there is not the plain walk by sampled tokens, or its ranks share rank
    0's samples (`eagle_sample` broadcasts them)."""
    if server_args.speculative_use_rejection_sampling:
        return "rejection sampling with draft probabilities"
    if (server_args.speculative_accept_threshold_single != 1.0
            or server_args.speculative_accept_threshold_acc != 1.0):
        return "acceptance thresholds below 1"
    if server_args.tp_size > 1 or getattr(server_args, "enable_dp_attention", False):
        return "more than one rank"
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
                prefix: torch.Tensor, device, check: bool = False, rrs=None):
    """-> (SGLang's `GenerationBatchResult` with next_token_ids / accept_lens / new_seq_lens
    set as its greedy path sets them, `Accepted`). The target KV of the accepted path is at the
    front of each verify block and its drafter KV appended when this returns (queued). `rrs`:
    (`sglang_tree_rrs.RejectionStage`, q `[bs, D, V]` of the round's sampled tree): the walk by
    recursive rejection sampling instead (not checked by `check`)."""
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
    if logits.hidden_states is None:
        raise RuntimeError("DFLASH_TREE: the verify returned no target hidden states")
    bs, w, info = len(batch.seq_lens), verify_input.draft_token_num, batch.sampling_info
    if rrs is not None:
        stage_rrs, q = rrs  # q's vocabulary is the model's (checked at start-up: `stages`)
        acc = stage_rrs.run(logits.next_token_logits, info.temperatures, q, tree,
                            batch.out_cache_loc, logits.hidden_states, prefix)
    else:
        choice = target_choice(logits.next_token_logits, info, bs, w)
        if check:
            want = (sglang_greedy(verify_input, batch, logits) if info.is_all_greedy
                    else sglang_walk(verify_input, choice))
        acc = stage.run(choice, tree, batch.out_cache_loc, logits.hidden_states, prefix)
        if check:
            compare(acc, *want, w)
    logits.hidden_states = None
    result = GenerationBatchResult(
        logits_output=logits, next_token_ids=acc.predict, can_run_cuda_graph=can_graph,
        speculative_num_draft_tokens=w, next_draft_input=None, accept_lens=acc.accept_lens,
        new_seq_lens=acc.new_seq_lens, routed_experts_output=out.routed_experts_output,
        indexer_topk_output=out.indexer_topk_output, extra_keep_alive_refs=[fb])
    return result, acc


def target_choice(logits: torch.Tensor,  # [bs * W, vocab] the verify's
                  info, bs: int, w: int) -> torch.Tensor:  # [bs, W] long
    """The target's token at every tree node: the argmax when every request is greedy, else
    a sample of softmax(logits / T) per node (`race_sample`), the argmax in greedy rows."""
    if info.is_all_greedy:
        return torch.argmax(logits, dim=-1).view(bs, w)
    greedy = (info.top_ks == 1).view(bs, 1) if info.is_any_greedy else None
    return race_sample(logits.view(bs, w, -1), info.temperatures.view(bs, 1, 1), greedy)


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


def sglang_walk(verify_input, choice: torch.Tensor):
    """SGLang's tree walk (`verify_tree_greedy_func`) of the sampled tokens `choice` [bs, W]."""
    from sglang.srt.speculative.eagle_utils import verify_tree_greedy_func

    bs, w = choice.shape
    dev = choice.device
    predict = torch.zeros(bs * w, dtype=torch.int32, device=dev)
    accept_index = torch.full((bs, verify_input.max_tree_depth), -1, dtype=torch.int32,
                              device=dev)
    num_correct = torch.empty(bs, dtype=torch.int32, device=dev)
    predict, accept_index, num_correct = verify_tree_greedy_func(
        predicts=predict, accept_index=accept_index, accept_token_num=num_correct,
        candidates=verify_input.draft_token.view(bs, w),
        retrieve_index=verify_input.retrieve_index,
        retrieve_next_token=verify_input.retrieve_next_token,
        retrieve_next_sibling=verify_input.retrieve_next_sibling, target_predict=choice,
        topk=verify_input.tree_topk)
    return predict, num_correct + 1, accept_index


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
