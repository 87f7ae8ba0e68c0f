"""DFLASH_TREE's SGLang worker: DFlash drafting, a token tree, EAGLE's tree verification.

NOT YET RUN ON A GPU. Written against SGLang 0.5.16's `DFlashWorkerV2` and `run_eagle_verify` (read,
not run: `sglang_tree_design.md` beside this file); on other versions `worker_class` raises
(0.5.23's DFlash worker differs too much: config-bag widths, `kv_loc_plan`, no `ps`). Per decode
round: the drafter runs one block of L tokens ([bonus, mask, ...]) exactly as SGLang's DFLASH does;
the top-K log-probs of depths 1..D (drafter hidden -> target LM head) give the tree of N nodes
(`fast/tree_build.build_tree`, on the device, no host sync); `sglang_tree_input` lays it out as a
`DFlashTreeVerifyInput`; SGLang's `run_eagle_verify` runs the target over the W = N + 1 tree tokens
with the FULL custom mask, accepts the longest path (greedy / target-only sampling) and moves the
accepted path's target KV and hidden states to the front; the drafter KV of that path is then
appended (KV injection) from the compacted hidden states. Prefill and idle rounds are DFLASH's.
`register_hooks` installs one HookRegistry AROUND hook so the target's verify CUDA graphs are
captured with the tree-mask buffer (DFLASH's capture input has none). """

from __future__ import annotations

import contextlib
import copy
import logging
from functools import cache

import torch

from ..fast.tree_build import build_tree
from .sglang_checks import sglang_version
from .sglang_tree_algo import NAME, WORKER_VERSIONS, TreeArgs, check_tree_args
from .sglang_tree_input import build_verify_tensors, make_verify_input

logger = logging.getLogger(__name__)

GET_SPEC_INFO = ("sglang.srt.model_executor.runner.decode_cuda_graph_runner."
                 "DecodeCudaGraphRunner.get_spec_info")


def _is_ours(algo) -> bool:
    return getattr(algo, "name", None) == NAME


def capture_spec_info(original, runner, num_tokens):
    """AROUND hook of `DecodeCudaGraphRunner.get_spec_info`: for DFLASH_TREE's *target* runner,
    capture the verify graphs with a tree input that carries the runner's custom-mask buffer
    (as EAGLE's / NGRAM's capture does); everything else is SGLang's."""
    mr = runner.model_runner
    if not _is_ours(mr.spec_algorithm) or mr.is_draft_worker:
        return original(runner, num_tokens)
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    cls = _verify_cls()
    return cls(draft_token=None, custom_mask=runner.buffers.custom_mask, positions=None,
               retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None,
               retrieve_cum_len=None, spec_steps=1,
               topk=max(2, int(mr.server_args.speculative_eagle_topk or 2)),
               draft_token_num=runner.captured_req_width,
               capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=None,
               seq_lens_cpu=None)


def _verify_cls():
    from .sglang_tree_input import verify_input_class

    return verify_input_class()


def register_hooks() -> None:
    """Install the capture hook once (HookRegistry applies it in `load_plugins`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(h is capture_spec_info for _, h, _ in HookRegistry._hooks.get(GET_SPEC_INFO, [])):
        HookRegistry.register(GET_SPEC_INFO, capture_spec_info, HookType.AROUND)


def _check_version() -> None:
    have = sglang_version()
    lo, hi = WORKER_VERSIONS
    if have is not None and not lo <= have <= hi:
        raise RuntimeError(f"{NAME}: the worker is written against SGLang 0.5.16's DFlash worker;"
                           f" SGLang {'.'.join(map(str, have))} is not supported yet")


def worker_factory(server_args) -> type:
    """What SGLang's registry calls (`SpeculativeAlgorithm.register`): the worker class."""
    return worker_class()


@cache
def worker_class() -> type:
    """`DFlashTreeWorker` (a subclass of SGLang 0.5.16's `DFlashWorkerV2`), defined on first
    use; raises a clear error on other SGLang versions."""
    _check_version()
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.eagle_worker_common import run_eagle_verify
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    class DFlashTreeWorker(DFlashWorkerV2):
        def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
            block = int(server_args.speculative_dflash_block_size)
            self.plan = check_tree_args(TreeArgs(int(server_args.speculative_num_draft_tokens),
                                                 int(server_args.speculative_eagle_topk), block))
            # The drafter (its runner, backends and graphs) sees a block of L tokens and top-1;
            # DFlashWorkerV2 reads its block size from speculative_num_draft_tokens, and
            # build_draft_tp_worker deep-copies these args again for the draft runner.
            draft_args = copy.copy(server_args)
            draft_args.speculative_num_draft_tokens = self.plan.block_size
            draft_args.speculative_eagle_topk = 1
            super().__init__(draft_args, gpu_id, ps, nccl_port, target_worker)
            self.server_args = server_args  # the global args (W, K) everywhere else

        def _maybe_build_draft_sampler(self):
            return None  # the tree needs top-K log-probs, not the in-graph argmax

        def _tree_logprobs(self, hidden: torch.Tensor, lm_head) -> torch.Tensor:
            """log-softmax of the target LM head over the drafter's hidden states
            `[bs, D, hidden]` -> `[bs, D, vocab]` (tp_size 1: validated at launch)."""
            logits = torch.nn.functional.linear(hidden, lm_head.weight)
            return logits.float().log_softmax(-1)

        def _draft_block(self, batch, draft_input):
            """DFLASH's drafter forward over [bonus, mask * (L - 1)] at prefix + arange(L);
            returns the drafter hidden states `[bs, L, hidden]`."""
            bs, L = len(batch.seq_lens), self.plan.block_size
            target_model = self.target_worker.model_runner.model
            req_to_token = self.model_runner.req_to_token_pool.req_to_token
            self._ensure_draft_block_buffers(bs)
            block_ids = self._draft_block_ids_buf[:bs]
            block_ids.fill_(int(self._mask_token_id))
            block_ids[:, 0].copy_(draft_input.bonus_tokens)
            positions = self._draft_block_positions_buf[:bs]
            torch.add(batch.seq_lens.unsqueeze(1), self._block_pos_offsets, out=positions)
            cache_loc = assign_extend_cache_locs_func(
                req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token,
                start_offset=batch.seq_lens, end_offset=batch.seq_lens + L, batch_size=bs,
                draft_token_num=L, device=self.device)
            embeds = target_model.get_input_embeddings()(block_ids)
            seq_lens_cpu = self._draft_seq_lens_cpu_buf[:bs]
            if batch.seq_lens_cpu is not None:  # host bound: committed prefix + one block
                seq_lens_cpu.copy_(batch.seq_lens_cpu)
                seq_lens_cpu.add_(L)
                seq_sum = int(seq_lens_cpu.sum())
            else:
                seq_lens_cpu.copy_(draft_input.reserved_seq_lens_cpu)
                seq_sum = int(draft_input.reserved_seq_lens_sum)
            fb = ForwardBatch(
                forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs,
                input_ids=block_ids.flatten(), req_pool_indices=batch.req_pool_indices,
                seq_lens=batch.seq_lens, out_cache_loc=cache_loc, seq_lens_sum=seq_sum,
                seq_lens_cpu=seq_lens_cpu, positions=positions.reshape(-1),
                input_embeds=embeds.view(-1, embeds.shape[-1]),
                spec_algorithm=SpeculativeAlgorithm.DFLASH,
                spec_info=self._draft_block_spec_info, capture_hidden_mode=CaptureHiddenMode.NULL)
            with torch.inference_mode():
                out = self.draft_model_runner.forward(fb)
            hidden = out.logits_output.hidden_states
            if hidden is None:
                raise RuntimeError(f"{NAME}: the drafter returned no hidden states")
            return hidden.view(bs, L, -1)

        def _verify_seq_bound(self, batch, draft_input) -> int:
            """Host upper bound of sum(seq_lens) for the FULL mask's size (over-size is safe;
            CPU lengths may lag one round under overlap: + W each)."""
            w = self.plan.width
            if batch.seq_lens_cpu is not None:
                return int(batch.seq_lens_cpu.sum()) + w * len(batch.seq_lens)
            if getattr(draft_input, "reserved_seq_lens_sum", None) is not None:
                return int(draft_input.reserved_seq_lens_sum)
            return len(batch.seq_lens) * self.target_worker.model_runner.attn_backend \
                .max_context_len

        def forward_batch_generation(self, batch, on_publish=None):
            if batch.forward_mode.is_extend() or batch.is_extend_in_batch or \
                    batch.forward_mode.is_idle():
                return super().forward_batch_generation(batch, on_publish=on_publish)
            if getattr(batch, "return_logprob", False):
                raise ValueError(f"{NAME} does not support return_logprob yet")
            draft_input = batch.spec_info
            if not isinstance(draft_input, DFlashDraftInputV2):
                raise RuntimeError(f"{NAME} expected DFlashDraftInputV2 on the running batch")
            p, bs = self.plan, len(batch.seq_lens)
            lm_head = self.target_worker.model_runner.model.lm_head
            # 1) draft, top-K per depth, tree (device only)
            hidden = self._draft_block(batch, draft_input)[:, 1:1 + p.depth]  # [bs, D, h]
            top_lp, top_ids = self._tree_logprobs(hidden, lm_head).topk(p.topk, dim=-1)
            tokens, parents, depths = build_tree(top_lp, top_ids, p.budget)  # [bs, N] each
            # 2) SGLang's tree-verify input, into the target backend's graph buffers if any
            mask_buf, pos_buf = self.target_worker.model_runner.attn_backend \
                .get_verify_buffers_to_fill_after_draft()
            seq_bound = self._verify_seq_bound(batch, draft_input)
            t = build_verify_tensors(tokens, parents, depths, draft_input.bonus_tokens,
                                     batch.seq_lens, seq_bound, p.depth, mask_out=mask_buf)
            positions = t.positions
            if pos_buf is not None:
                pos_buf[:positions.numel()].copy_(positions)
                positions = pos_buf[:positions.numel()]
            verify = make_verify_input(t, seq_lens_sum=seq_bound,
                                       seq_lens_cpu=batch.seq_lens_cpu, topk=p.topk)
            verify.positions = positions
            prefix = batch.seq_lens.clone()
            batch.spec_info = verify
            # 3) target verify + acceptance + target KV compaction (SGLang's EAGLE path)
            result = run_eagle_verify(
                batch, target_worker=self.target_worker,
                req_to_token_pool=self.model_runner.req_to_token_pool,
                token_to_kv_pool_allocator=self.model_runner.token_to_kv_pool_allocator,
                plan_stream=None, plan_stream_ctx=contextlib.nullcontext(), topk=verify.topk,
                num_steps=p.depth, num_draft_tokens=p.width, device=self.device,
                metadata_ready_pre_pad=False, finalize_tree_path=True)
            commit = result.accept_lens.to(torch.int32)  # accepted drafts + bonus, [bs]
            new_seq_lens = prefix + commit.to(prefix.dtype)
            if on_publish is not None:
                on_publish(new_seq_lens)
            # 4) drafter KV of the accepted path (now at the front of each request's block)
            d1 = p.depth + 1
            hid = result.logits_output.hidden_states
            if hid is None:
                raise RuntimeError(f"{NAME}: verify returned no target hidden states")
            hid = hid.view(bs, p.width, -1)[:, :d1]
            loc = assign_extend_cache_locs_func(
                req_pool_indices=batch.req_pool_indices,
                req_to_token=self.model_runner.req_to_token_pool.req_to_token,
                start_offset=prefix, end_offset=prefix + d1, batch_size=bs, draft_token_num=d1,
                device=self.device)
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=hid.reshape(-1, hid.shape[-1]), cache_loc=loc,
                cache_loc_2d=loc.view(bs, d1), positions=(prefix[:, None] + torch.arange(
                    d1, device=prefix.device)).reshape(-1), commit_lens=commit)
            result.logits_output.hidden_states = None
            bonus = result.next_draft_input.bonus_tokens.to(torch.int64)
            result.next_draft_input = self._make_next_draft_input_decode(
                bonus_tokens=bonus, new_seq_lens=new_seq_lens)
            result.new_seq_lens = new_seq_lens
            result.accept_lens = commit
            return result

    return DFlashTreeWorker
