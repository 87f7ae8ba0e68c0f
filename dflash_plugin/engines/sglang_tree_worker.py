"""DFLASH_TREE's SGLang worker: DFlash drafting, a token tree, EAGLE's tree verification.

Ran on the H200 (SGLang 0.5.16, since 2026-12-01; BENCHMARKS.md "DFLASH_TREE inside SGLang").
Written against SGLang 0.5.16's `DFlashWorkerV2` and `run_eagle_verify` (`sglang_tree_design.md`
beside this file); on other versions `worker_class` raises (0.5.23's DFlash worker differs too
much: config-bag widths, `kv_loc_plan`, no `ps`). Per decode round: the drafter runs one block of
L tokens ([bonus, mask, ...]) as SGLang's DFLASH does; the top-K log-probs of depths 1..D
(drafter hidden -> target LM head) give the tree of N nodes and its verify tensors
(`sglang_tree_stage`: on the device, one CUDA graph per batch bucket); `sglang_tree_input` lays
it out as a `DFlashTreeVerifyInput`; SGLang's `run_eagle_verify` runs the target over the W = N +
1 tree tokens with the FULL custom mask, accepts the longest path (greedy / target-only
sampling) and moves the path's target KV and hidden states to the front; the path's drafter KV
is then appended from them (`sglang_tree_append`, a graph per bucket). With
`DFLASH_TREE_FAST_ACCEPT=1` a greedy round replaces EAGLE's acceptance, both moves and the append
with one graph per bucket (`sglang_tree_verify`, `sglang_tree_accept`). Prefill and idle rounds
are DFLASH's. `sglang_tree_hooks` holds the HookRegistry hooks: the target's verify graphs are
captured with the tree-mask buffer (DFLASH's capture input has none)."""

from __future__ import annotations

import contextlib
import copy
import logging
from functools import cache

import torch

from .sglang_buckets import bucket_limit, graphs_enabled
from .sglang_checks import sglang_version
from .sglang_prefill import enabled as async_prefill_enabled
from .sglang_prefill import prefill
from .sglang_tree_accept import AcceptStage
from .sglang_tree_algo import (
    NAME,
    WORKER_VERSIONS,
    TreeArgs,
    check_target_backend,
    check_tree_args,
)
from .sglang_tree_append import AppendStage, accepted_path, drafter_input, fused_workspaces
from .sglang_tree_input import make_verify_input, with_mask
from .sglang_tree_plan import install, layout_from_env
from .sglang_tree_profile import RoundProfile, profile_every
from .sglang_tree_rrs import rrs_stages, takes
from .sglang_tree_seqlens import (
    SeqLensMirror,
    give_host_lens,
    late_seq_lens_from_env,
    wrap_publish,
)
from .sglang_tree_stage import TreeStage, triton_kernels_from_env
from .sglang_tree_tp import replicated_head, tree_topk
from .sglang_tree_verify import (
    fast_accept_from_env,
    republish_read_done,
    round_slow_reason,
    sampling_slow_reason,
    server_slow_reason,
    verify_fast,
)

logger = logging.getLogger(__name__)

def draft_server_args(server_args, block_size: int):
    """The drafter's server args: a block of `block_size` (L) tokens and top-1, so DFLASH's
    worker, its draft runner, backends and graphs size for L (`DFlashWorkerV2` reads its block
    from `speculative_num_draft_tokens`; `build_draft_tp_worker` deep-copies these again). A deep
    copy changed through `override(source, **fields)`: 0.5.16's resolved ServerArgs reject a bare
    assignment under SGLANG_STRICT_CONFIG_MUTATION (`server_args.py` `__setattr__`), and a
    shallow copy would share the override logs with the global args."""
    args = copy.deepcopy(server_args)
    args.override(f"{NAME.lower()}.draft_block", speculative_num_draft_tokens=int(block_size),
                  speculative_eagle_topk=1)
    return args


def draft_block_forward_batch(*, block_ids, positions, cache_loc, req_pool_indices, seq_lens,
                              seq_lens_cpu, seq_lens_sum, input_embeds, spec_info):
    """The drafter's forward over one block ([bs, L] ids), built as DFLASH's decode does it
    (0.5.16 `dflash_worker_v2.py` `forward_batch_generation`, the `ForwardBatch(...)` of step 1):
    TARGET_VERIFY mode, DFLASH's spec algorithm and draft-block spec input, noise embeddings."""
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=int(block_ids.shape[0]),
        input_ids=block_ids.flatten(), req_pool_indices=req_pool_indices, seq_lens=seq_lens,
        out_cache_loc=cache_loc, seq_lens_sum=seq_lens_sum, seq_lens_cpu=seq_lens_cpu,
        positions=positions.reshape(-1), input_embeds=input_embeds.view(-1, input_embeds.shape[-1]),
        spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=spec_info,
        capture_hidden_mode=CaptureHiddenMode.NULL)


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
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.eagle_worker_common import run_eagle_verify

    class DFlashTreeWorker(DFlashWorkerV2):
        def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
            block = int(server_args.speculative_dflash_block_size)
            self.plan = check_tree_args(TreeArgs(int(server_args.speculative_num_draft_tokens),
                                                 int(server_args.speculative_eagle_topk), block))
            # the drafter sees a block of L tokens and top-1 (see draft_server_args)
            super().__init__(draft_server_args(server_args, self.plan.block_size), gpu_id, ps,
                             nccl_port, target_worker)
            self.server_args = server_args  # the global args (W, K) everywhere else
            # DFLASH_TREE_PROFILE=N: per-phase round times in the log (sglang_tree_profile)
            self.profile = RoundProfile(profile_every(), torch.device(self.device))
            self._graph_logged, self._draft_graph = set(), False  # for the profile's log
            # tree phase, drafter-KV append: a CUDA graph per batch bucket (0: eager)
            device, graphs = torch.device(self.device), graphs_enabled()
            # the whole LM head on every TP rank: the same tree everywhere (sglang_tree_tp)
            mr = self.target_worker.model_runner
            self._head = replicated_head(mr.model.lm_head, getattr(mr, "tp_group", None))
            if self._head is not mr.model.lm_head:
                logger.info("%s: the whole LM head %s gathered on this TP rank", NAME,
                            tuple(self._head.weight.shape))
            kernels = triton_kernels_from_env(device)  # DFLASH_TREE_KERNELS=triton
            self.tree_stage = TreeStage(device, self._tree_topk, self.plan.budget,
                                        self.plan.depth, graphs, kernels)
            self.append_stage = AppendStage(
                device, self._append_target_hidden_to_draft_kv_by_loc, graphs,
                keep=lambda: fused_workspaces(self))
            # DFLASH_TREE_FAST_ACCEPT=1: the acceptance and both KV moves in one graph
            self._fast_accept, self._fast_check = fast_accept_from_env()
            why = sampling_slow_reason(server_args) if self._fast_accept else None
            if why:
                logger.info("%s: T > 0 rounds take SGLang's acceptance: %s", NAME, why)
            self._fast_sampling = self._fast_accept and why is None
            self.accept_stage = AcceptStage(
                device, lambda tgt, src: self._kvcache().move_kv_cache(tgt, src),
                self._append_target_hidden_to_draft_kv_by_loc, self.plan.width, self.plan.depth,
                graphs, keep=lambda: fused_workspaces(self), triton=kernels)
            # DFLASH_TREE_RRS=1: T > 0 rounds by recursive rejection sampling (sglang_tree_rrs)
            self._rrs, why = rrs_stages(self, device, graphs, kernels)
            if why:
                logger.info("%s: DFLASH_TREE_RRS off: %s", NAME, why)
            self._warm_stages(server_args)
            # tree-verify replays plan without a host sync (DFLASH_TREE_HOST_PLAN=0: flashinfer's)
            self._verify_layout = layout_from_env(self.plan.width)
            self._plan_installed = False
            # DFLASH_TREE_LATE_SEQ_LENS=1: no scheduler sync for seq_lens_cpu; our own host
            # mirror, read after the drafter and tree phase are queued (sglang_tree_seqlens)
            self._late_seq_lens, self._late_check = late_seq_lens_from_env()
            self._mirror = None
            self._async_prefill = async_prefill_enabled()  # DFLASH_ASYNC_PREFILL

        @property
        def spec_v2_attn_backends(self) -> tuple:
            """Asked by the scheduler whether to sync for `seq_lens_cpu`: with late seq lens
            the drafter's backend only (the verify gets them from our mirror)."""
            if getattr(self, "_late_seq_lens", False):
                return (self.draft_model_runner.attn_backend,)
            return super().spec_v2_attn_backends

        def _seq_lens_mirror(self) -> SeqLensMirror:
            if self._mirror is None:  # the request pool exists once the worker is built
                slots = int(self.model_runner.req_to_token_pool.req_to_token.shape[0])
                self._mirror = SeqLensMirror(slots, torch.device(self.device))
            return self._mirror

        def _publish(self, batch, on_publish):
            if not self._late_seq_lens:
                return on_publish
            return wrap_publish(on_publish, self._seq_lens_mirror(), batch.req_pool_indices)

        def _warm_stages(self, server_args) -> None:
            """Capture the tree phase for every batch bucket up to the running-request limit
            now, not inside the first rounds of each batch size (see sglang_buckets)."""
            limit = bucket_limit(server_args)
            if not limit:
                return  # no bound known: buckets are captured on first use
            head = self._head.weight
            sizes = self.tree_stage.warm(limit, int(head.shape[1]), head.dtype)
            if sizes:
                logger.info("%s: tree phase captured for batch buckets %s", NAME, sizes)

        def init_cuda_graphs(self):
            """SGLang 0.5.16 starts a worker in steps (`__init__`, `alloc_memory_pool`,
            `init_attention_backends`, `init_cuda_graphs`; scheduler.py): the drafter's KV pool
            exists only after `alloc_memory_pool`, so the drafter-KV append is captured here.
            Captured in `__init__` it met no `token_to_kv_pool` and SGLang's own fallback
            turned DFLASH's fused append off for good (H200, 2026-12-03). The target's attention
            backend exists by now (SGLang builds the backends after the workers): checked here."""
            check_target_backend(self.target_worker.model_runner.attn_backend)
            super().init_cuda_graphs()
            sizes = self.append_stage.warm_for(self, self.plan.depth + 1)
            if sizes:
                logger.info("%s: drafter-KV append captured for batch buckets %s", NAME, sizes)
            why = server_slow_reason(self.target_worker, self._kvcache()) \
                if self._fast_accept else None  # settled by now: the pools exist
            if why:
                logger.info("%s: DFLASH_TREE_FAST_ACCEPT off for this server: %s", NAME, why)
                self._fast_accept = False
            known = drafter_input(self) if self._fast_accept else None
            if known is not None and self.accept_stage.warm(*known):
                logger.info("%s: greedy acceptance captured for batch buckets up to %d", NAME,
                            known[0])
            self._rrs = self._rrs if self._fast_accept else None
            if self._rrs is not None and known is not None:  # its tree phase and walk
                w = self._head.weight
                self._rrs[0].warm(known[0], int(w.shape[1]), w.dtype)
                self._rrs[1].warm(*known)

        def _kvcache(self):
            return self.model_runner.token_to_kv_pool_allocator.get_kvcache()

        def _host_plan(self, seq_lens_cpu) -> None:
            """The layout of the coming verify replay (`sglang_tree_plan`); the target's
            graph wrappers get the sync-free plan at the first round (captured by then)."""
            mr = self.target_worker.model_runner
            if not self._plan_installed:
                runner = mr.decode_cuda_graph_runner
                self._verify_layout.fill = int(getattr(runner, "seq_len_fill_value", 1) or 1)
                n = install(mr.attn_backend, self._verify_layout)
                logger.info("%s: sync-free tree-verify plan on %d graph wrappers", NAME, n)
                self._plan_installed = True
            self._verify_layout.seq_lens_cpu = seq_lens_cpu

        def _tree_topk(self, hidden):  # [bs, D, h] -> top-K log-probs, ids [bs, D, K]
            return tree_topk(hidden, self._head, self.plan.topk)

        def _maybe_build_draft_sampler(self):
            return None  # the tree needs top-K log-probs, not the in-graph argmax

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
            elif draft_input.reserved_seq_lens_cpu is not None:  # reserved: an over-estimate
                seq_lens_cpu.copy_(draft_input.reserved_seq_lens_cpu)
                seq_sum = int(draft_input.reserved_seq_lens_sum)
            else:  # DFLASH's last resort (a blocking D2H copy; dflash_worker_v2.py, 0.5.16)
                seq_lens_cpu.copy_(batch.seq_lens.to("cpu", dtype=torch.int32))
                seq_sum = int(seq_lens_cpu.sum())
            fb = draft_block_forward_batch(
                block_ids=block_ids, positions=positions, cache_loc=cache_loc,
                req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                seq_lens_cpu=seq_lens_cpu, seq_lens_sum=seq_sum, input_embeds=embeds,
                spec_info=self._draft_block_spec_info)
            with torch.inference_mode():
                out = self.draft_model_runner.forward(fb)
            self._draft_graph = bool(getattr(out, "can_run_graph", False))
            hidden = out.logits_output.hidden_states
            if hidden is None:
                raise RuntimeError(f"{NAME}: the drafter returned no hidden states")
            return hidden.view(bs, L, -1)

        def _verify_seq_bound(self, batch, draft_input) -> int:
            """Host upper bound of sum(seq_lens) for the FULL mask's size. Over-size is safe;
            0.5.16 hands the verify exact CPU lengths in both schedules (overlap:
            `FutureMap.resolve_seq_lens_cpu`), so the + W each is only headroom."""
            w = self.plan.width
            if batch.seq_lens_cpu is not None:
                return int(batch.seq_lens_cpu.sum()) + w * len(batch.seq_lens)
            if getattr(draft_input, "reserved_seq_lens_sum", None) is not None:
                return int(draft_input.reserved_seq_lens_sum)
            return len(batch.seq_lens) * self.target_worker.model_runner.attn_backend \
                .max_context_len

        def forward_batch_generation(self, batch, on_publish=None):
            extend = batch.forward_mode.is_extend() or batch.is_extend_in_batch
            if extend and self._async_prefill:  # DFLASH's prefill without its host sync
                return prefill(self, batch, self._publish(batch, on_publish))
            if extend or batch.forward_mode.is_idle():
                return super().forward_batch_generation(
                    batch, on_publish=self._publish(batch, on_publish))
            if getattr(batch, "return_logprob", False):
                raise ValueError(f"{NAME} does not support return_logprob yet")
            draft_input = batch.spec_info
            if not isinstance(draft_input, DFlashDraftInputV2):
                raise RuntimeError(f"{NAME} expected DFlashDraftInputV2 on the running batch")
            p, ev = self.plan, self.profile.start()
            fast = self._fast_accept and round_slow_reason(batch, self._fast_sampling) is None
            rrs = (self._rrs if fast and self._rrs is not None
                   and takes(batch.sampling_info, len(batch.seq_lens)) else None)
            # 1) draft, then top-K per depth, tree and verify tensors (device only, one graph)
            hidden = self._draft_block(batch, draft_input)[:, 1:1 + p.depth]  # [bs, D, h]
            self.profile.mark(ev, 0)
            if rrs is not None:  # siblings drawn from the drafter's q (kept for the walk)
                parts, q = rrs[0].run(hidden, draft_input.bonus_tokens, batch.seq_lens,
                                      batch.sampling_info.temperatures)
            else:
                parts = self.tree_stage.run(hidden, draft_input.bonus_tokens, batch.seq_lens)
            # 2) SGLang's tree-verify input, into the target backend's graph buffers if any
            late = self._late_seq_lens and batch.seq_lens_cpu is None
            if late:  # waits for the previous round's copy only: drafter and tree are queued
                give_host_lens(batch, self._seq_lens_mirror(), self._late_check)
            mask_buf, pos_buf = self.target_worker.model_runner.attn_backend \
                .get_verify_buffers_to_fill_after_draft()
            seq_bound = self._verify_seq_bound(batch, draft_input)
            t = with_mask(parts, batch.seq_lens, seq_bound, mask_buf)
            positions = t.positions
            if pos_buf is not None:
                pos_buf[:positions.numel()].copy_(positions)
                positions = pos_buf[:positions.numel()]
            verify = make_verify_input(t, seq_lens_sum=seq_bound,
                                       seq_lens_cpu=batch.seq_lens_cpu, topk=p.topk)
            verify.positions = positions
            prefix = batch.seq_lens.clone()
            batch.spec_info = verify
            self.profile.mark(ev, 1)
            # 3) target verify + acceptance + target KV compaction (SGLang's EAGLE path)
            if self._verify_layout is not None:
                self._host_plan(batch.seq_lens_cpu)
            if fast:  # acceptance, target-KV move and drafter-KV append: one graph
                result, acc = verify_fast(
                    batch, target_worker=self.target_worker, stage=self.accept_stage,
                    req_to_token_pool=self.model_runner.req_to_token_pool, tree=parts,
                    prefix=prefix, device=self.device, check=self._fast_check,
                    rrs=None if rrs is None else (rrs[1], q))
            else:
                result = run_eagle_verify(
                    batch, target_worker=self.target_worker,
                    req_to_token_pool=self.model_runner.req_to_token_pool,
                    token_to_kv_pool_allocator=self.model_runner.token_to_kv_pool_allocator,
                    plan_stream=None, plan_stream_ctx=contextlib.nullcontext(),
                    topk=verify.topk, num_steps=p.depth, num_draft_tokens=p.width,
                    device=self.device, metadata_ready_pre_pad=False, finalize_tree_path=True)
            if self._verify_layout is not None:
                self._verify_layout.seq_lens_cpu = None  # known for this replay only
            if late:  # as the scheduler left them (it takes the GPU-only path)
                batch.seq_lens_cpu = batch.seq_lens_sum = None
            republish_read_done(self.target_worker.model_runner, self.device)
            self.profile.mark(ev, 2)
            commit = result.accept_lens.to(torch.int32)  # accepted drafts + bonus, [bs]
            new_seq_lens = acc.new_seq_lens if fast else prefix + commit.to(prefix.dtype)
            on_publish = self._publish(batch, on_publish)
            if on_publish is not None:
                on_publish(new_seq_lens)
            if not fast:  # 4) drafter KV of the path (the front of each verify block now;
                # its slots: the verify's out_cache_loc = req_to_token[prefix : prefix + W])
                hid = result.logits_output.hidden_states
                if hid is None:
                    raise RuntimeError(f"{NAME}: verify returned no target hidden states")
                self.append_stage.run(*accepted_path(hid, batch.out_cache_loc, prefix, commit,
                                                     p.width, p.depth + 1))
                result.logits_output.hidden_states = None
            bonus = acc.bonus if fast else result.next_draft_input.bonus_tokens.to(torch.int64)
            result.next_draft_input = self._make_next_draft_input_decode(
                bonus_tokens=bonus, new_seq_lens=new_seq_lens)
            result.new_seq_lens = new_seq_lens
            result.accept_lens = commit
            self.profile.mark(ev, 3)
            if ev is not None and len(batch.seq_lens) not in self._graph_logged:
                self._graph_logged.add(len(batch.seq_lens))
                logger.info("%s profile, batch %d: drafter CUDA graph %s, target verify CUDA "
                            "graph %s", NAME, len(batch.seq_lens), self._draft_graph,
                            bool(getattr(result, "can_run_cuda_graph", False)))
            self.profile.end(ev, len(batch.seq_lens))
            return result

    return DFlashTreeWorker
