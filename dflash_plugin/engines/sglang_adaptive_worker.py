"""DFLASH_ADAPTIVE's SGLang worker: SGLang 0.5.16's `DFlashWorkerV2` with one runtime state per
block length q, switched before every decode step.

A state is what DFLASH's decode step reads that depends on its block: the block size itself,
the drafter block's position offsets and spec input, the step's buffers, the target's verify
attention backend and CUDA graphs (width q), the drafter's (block q). The server's own block W
is DFLASH's state as SGLang built it; the others are built after SGLang's `init_cuda_graphs`, the
way SGLang's EAGLE adaptive mode builds its states (`eagle_worker_v2.py`
`build_adaptive_runtime_state`, 0.5.16): a fresh attention backend and `DecodeCudaGraphRunner`
per runner, with the server args' `speculative_num_draft_tokens` set to q while they capture.
q = 1 is plain decoding through DFLASH's own step: no drafter forward (the drafter runner is
wrapped so its forward returns nothing and the head reads an empty draft; the block's noise
embedding, which only the drafter reads, is not computed), a one-token target verify, and the
drafter's KV of that token appended as every step does, so a later q > 1 drafts from a current
context. The scheduler keeps reserving W slots per request and step (SGLang's
server args stay at W); a step reports its own q (`speculative_num_draft_tokens` of the
result), which SGLang's result processing reads per result. The choice per step is
`adaptive.ServerPolicy`: step times from `dflash tune --engine sglang` at first, replaced by the
server's own (launch to launch of decode steps, `adaptive.StepClock`; probes of two steps),
acceptance from SGLang's `on_verify_complete_cpu` (results read back one step late in overlap
mode).

The drafter-KV append of a decode step (DFLASH's `_append_target_hidden_to_draft_kv_by_loc`
with the step's `[bs, q]` slots and commit lengths) replays one CUDA graph per (q, batch
bucket), captured after `init_cuda_graphs` as DFLASH_TREE's append is (`sglang_tree_append`):
eager, it was 0.36-0.89 ms of host time in every step on the H200 (2026-12-03 profile,
BENCHMARKS.md). `DFLASH_TREE_GRAPHS=0` (or a failed capture, logged) keeps it eager.
A prefill's append replays graphs too (`sglang_prefill_append`; `DFLASH_PREFILL_APPEND=0`:
DFLASH's eager append).
The q = 1 steps' appends are held (`DFLASH_ADAPTIVE_DEFER_APPEND`, up to 1024 tokens by default)
and written in one call before anything reads or reuses those drafter slots
(`sglang_adaptive_defer`), and with `DFLASH_ADAPTIVE_PLAIN_ATTENTION=1` (off by default) the
q = 1 state's target backend attends as a plain decode step (`sglang_plain_attention`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import time
import types
from functools import cache

import torch

from ..adaptive import LaunchLedger, ServerPolicy, StepClock
from .sglang_adaptive import FLAG, NAME, PROBE_STEPS, SERVER_CONFIG, load_step_times
from .sglang_adaptive_defer import DeferredAppend, capacity_from_env
from .sglang_buckets import graphs_enabled
from .sglang_plain_attention import enabled as plain_attention_enabled
from .sglang_plain_attention import plain_step_backend
from .sglang_prefill import enabled as async_prefill_enabled
from .sglang_prefill import prefill
from .sglang_prefill_append import append_prompt, stage_for
from .sglang_prefill_append import mode as prefill_append_mode
from .sglang_tree_append import AppendStage, fused_workspaces
from .sglang_tree_worker import _check_version

logger = logging.getLogger(__name__)

# DFlashWorkerV2 (0.5.16) attributes that belong to one block length
STATE_ATTRS = (
    "block_size", "speculative_num_draft_tokens", "_block_pos_offsets",
    "_draft_block_spec_info", "_draft_block_ids_buf", "_draft_block_positions_buf",
    "_draft_block_tokens_buf", "_draft_verify_out_cache_loc_buf", "_draft_block_end_buf",
    "_draft_seq_lens_cpu_buf", "_accept_bonus_buffer_cap", "_accept_bonus_buffer_slot",
    "_accept_len_buf", "_commit_lens_bufs", "_bonus_id_bufs", "_out_tokens_bufs",
    "_new_seq_lens_bufs", "_draft_sampler", "draft_model_runner")
RUNNER_ATTRS = ("attn_backend", "decode_cuda_graph_runner")


def fresh_attrs(q: int, offsets, spec_info) -> dict:
    """A new state's worker attributes before its first step (buffers grow on first use, as
    DFLASH's do)."""
    return dict(block_size=q, speculative_num_draft_tokens=q, _block_pos_offsets=offsets,
                _draft_block_spec_info=spec_info, _draft_block_ids_buf=None,
                _draft_block_positions_buf=None, _draft_block_tokens_buf=None,
                _draft_verify_out_cache_loc_buf=None, _draft_block_end_buf=None,
                _draft_seq_lens_cpu_buf=None, _accept_bonus_buffer_cap=0,
                _accept_bonus_buffer_slot=0, _accept_len_buf=None, _commit_lens_bufs=[],
                _bonus_id_bufs=[], _out_tokens_bufs=[], _new_seq_lens_bufs=[],
                _draft_sampler=None)


class NoDraft:
    """The drafter runner in the q = 1 state: `forward` returns no draft (DFLASH's step then
    reads `EmptyDraft.out[:0]`); everything else (KV pool, backend) is the real runner's."""

    def __init__(self, runner):
        self._runner = runner

    def forward(self, forward_batch):
        return types.SimpleNamespace(logits_output=None, can_run_graph=True)

    def __getattr__(self, name):
        return getattr(self._runner, name)


class EmptyDraft:
    """The drafter head in the q = 1 state: zero drafted tokens per request."""

    def __init__(self, device):
        self.out = torch.empty(0, dtype=torch.int64, device=device)


class BlockEmbeddingSkipped:
    """The target's input embedding as DFLASH's step calls it in the q = 1 state: the drafter
    block's noise embedding (the block's ids through the target's table), which only the
    drafter's forward reads and q = 1 runs none, comes back as an uninitialised `[bs, 1, h]`
    tensor (0.14-0.24 ms of host time per step on the H200, 2026-12-03 profiles); ids in any
    other tensor (a target forward's own) go through the real table."""

    def __init__(self, embed, block_ids):
        self.embed, self.block_ids = embed, block_ids  # block_ids(): the worker's buffer now
        self.width, self.dtype = embed.weight.shape[-1], embed.weight.dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        buf = self.block_ids()
        if buf is not None and ids.dim() == 2 and ids.data_ptr() == buf.data_ptr():
            return torch.empty((*ids.shape, self.width), dtype=self.dtype, device=ids.device)
        return self.embed(ids)


@contextlib.contextmanager
def input_embeddings_as(model, embed):
    """`model.get_input_embeddings()` returns `embed` inside (an instance attribute over the
    class's method), the model as it was after, even if the step raised."""
    own = vars(model).get("get_input_embeddings")
    model.get_input_embeddings = lambda: embed
    try:
        yield
    finally:
        if own is None:
            del model.get_input_embeddings
        else:
            model.get_input_embeddings = own


@contextlib.contextmanager
def draft_tokens_set_to(args_list, q: int):
    """Each distinct ServerArgs with `speculative_num_draft_tokens = q` inside (SGLang's
    backends and graph runners size from it), restored after."""
    seen = {id(a): a for a in args_list}.values()
    old = [(a, a.speculative_num_draft_tokens) for a in seen]
    for a, _ in old:
        a.override(f"{NAME.lower()}.capture", speculative_num_draft_tokens=q)
    try:
        yield
    finally:
        for a, w in old:
            a.override(f"{NAME.lower()}.restore", speculative_num_draft_tokens=w)


def memory_note() -> str:
    """The caching allocator's retries so far (each frees cached blocks and synchronizes the
    device: a server short of memory slows every step) and the device's free memory."""
    if not torch.cuda.is_available():
        return "memory: no CUDA device"
    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    return (f"memory: allocator retries {stats.get('num_alloc_retries', 0)}, reserved "
            f"{stats.get('reserved_bytes.all.current', 0) / 2**30:.2f} GiB, free "
            f"{free / 2**30:.2f} of {total / 2**30:.1f} GiB")


def build_runner_state(model_runner, q: int, graphs: bool, plain_attention: bool = False
                       ) -> dict:
    """A fresh attention backend for `model_runner` and, with graphs, its decode CUDA graphs
    of width q (call inside `draft_tokens_set_to`). The runner's capture tail hooks (DFLASH's
    in-graph draft head, sized for W) are off while capturing. plain_attention: the backend
    attends a one-token verify as a decode step (`sglang_plain_attention`), graphs included."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    keep = model_runner.init_new_workspace
    try:
        backend = model_runner._get_attention_backend(init_new_workspace=True)
    finally:
        model_runner.init_new_workspace = keep
    if plain_attention:
        backend = plain_step_backend(backend)
    runner = None
    if graphs:
        hooks = list(model_runner.capture_tail_hooks)
        model_runner.capture_tail_hooks.clear()
        try:
            runner = DecodeCudaGraphRunner(model_runner, attn_backend=backend,
                                           speculative_num_draft_tokens=q)
        finally:
            model_runner.capture_tail_hooks.extend(hooks)
    return {"attn_backend": backend, "decode_cuda_graph_runner": runner}


def worker_factory(server_args) -> type:
    return worker_class()


@cache
def worker_class() -> type:
    """`DFlashAdaptiveWorker` (a subclass of SGLang 0.5.16's `DFlashWorkerV2`)."""
    _check_version()
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.draft_worker_common import (
        build_block_pos_offsets,
        make_draft_block_spec_info,
    )

    class DFlashAdaptiveWorker(DFlashWorkerV2):
        _prompt_mode, _prompt_append = "0", None  # until `__init__` reads DFLASH_PREFILL_APPEND

        def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
            super().__init__(server_args, gpu_id, ps, nccl_port, target_worker)
            w = int(self.block_size)
            self.max_q = w
            self._draft_mr = self.draft_model_runner  # the real one (q = 1 swaps in NoDraft)
            rows = load_step_times(getattr(server_args, FLAG, None), w)
            self.policy = ServerPolicy(SERVER_CONFIG, rows, w, probe_steps=PROBE_STEPS)
            self._states: dict[int, dict] = {}
            self._q = w
            self._issued = collections.deque(maxlen=256)  # (bs, q) not yet read back
            self._steps = collections.Counter()  # q -> decode steps issued
            self._clock = StepClock()  # step times from decode launches
            self.ledger = LaunchLedger()  # wall time between launches, by pass kind (the log)
            self._log_every = int(os.environ.get("DFLASH_ADAPTIVE_LOG_EVERY", "1000"))
            self._appends: dict[int, AppendStage] = {}  # q -> its decode append's graphs
            self._no_noise = None  # BlockEmbeddingSkipped (or False), at the first q = 1 step
            held = capacity_from_env()  # q = 1 steps' drafter-context rows written late
            self._held = DeferredAppend(held) if held else None
            self._held_reqs = ()  # the batch's requests (ids) while rows are held
            self._async_prefill = async_prefill_enabled()  # DFLASH_ASYNC_PREFILL
            self._prompt_mode = prefill_append_mode()  # its graphs: `_capture_appends`

        def _runners(self):
            return {"target": self.target_worker.model_runner, "draft": self._draft_mr}

        def _snapshot(self) -> dict:
            st = {a: getattr(self, a) for a in STATE_ATTRS}
            for key, mr in self._runners().items():
                st[key] = {a: getattr(mr, a) for a in RUNNER_ATTRS}
            return st

        def _build_state(self, q: int, graphs: bool) -> dict:
            dev = self.device
            st = fresh_attrs(q, build_block_pos_offsets(length=q, device=dev),
                             make_draft_block_spec_info(draft_token_num=q, device=dev))
            target, draft = self.target_worker.model_runner, self._draft_mr
            with draft_tokens_set_to([self.server_args, target.server_args,
                                      draft.server_args], q):
                st["target"] = build_runner_state(target, q, graphs, plain_attention=(
                    q == 1 and plain_attention_enabled()))
                # q = 1 runs no drafter: the drafter keeps W's backend and graphs
                st["draft"] = (build_runner_state(draft, q, graphs) if q > 1 else
                               {a: getattr(draft, a) for a in RUNNER_ATTRS})
            st["draft_model_runner"] = draft if q > 1 else NoDraft(draft)
            if q == 1:
                st["_draft_sampler"] = EmptyDraft(dev)
            return st

        def init_cuda_graphs(self):
            """DFLASH's graphs for W (SGLang's), then every other q of the policy."""
            from sglang.srt.model_executor.cuda_graph_config import Backend

            super().init_cuda_graphs()
            graphs = self.server_args.cuda_graph_config.decode.backend != Backend.DISABLED
            self._states[self.max_q] = self._snapshot()
            for q in self.policy.blocks():
                if q not in self._states:
                    self._states[q] = self._build_state(q, graphs)
            self._capture_appends(graphs and graphs_enabled())
            logger.info("%s: runtime states for block lengths %s (graphs %s); step times "
                        "for batch sizes %s; %s", NAME, sorted(self._states), graphs,
                        sorted(self.policy.policies), memory_note())

        def _capture_appends(self, graphs: bool) -> None:
            """One `AppendStage` per q, every batch bucket up to the running-request limit
            captured now (the drafter's KV pool exists only after `alloc_memory_pool`)."""
            if not graphs:
                return
            eager = functools.partial(DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc,
                                      self)
            for q in sorted(self._states):
                stage = AppendStage(torch.device(self.device), eager, True,
                                    keep=functools.partial(fused_workspaces, self))
                if stage.warm_for(self, q):
                    self._appends[q] = stage
            if self._prompt_mode != "0":
                self._prompt_append = stage_for(self, eager, functools.partial(
                    fused_workspaces, self))
            logger.info("%s: drafter-KV append captured for block lengths %s; prompts' "
                        "append: %s", NAME, sorted(self._appends), None if not (
                            p := self._prompt_append) else f"up to {p.max_tokens} tokens")

        def _append_target_hidden_to_draft_kv_by_loc(self, *, target_hidden, cache_loc,
                                                     positions, cache_loc_2d=None,
                                                     commit_lens=None):
            """A decode step's append (dense `[bs, q]` slots, commit lengths) through q's
            graphs (q = 1 with DFLASH_ADAPTIVE_DEFER_APPEND: held, `_write_held`); a
            prefill's (neither given) and any other shape: DFLASH's, eager."""
            step = (cache_loc_2d is not None and commit_lens is not None
                    and cache_loc_2d.ndim == 2 and int(cache_loc_2d.shape[1]) == self._q)
            if (step and self._q == 1 and self._held is not None
                    and int(cache_loc_2d.shape[0]) <= self._held.capacity):
                bs = int(cache_loc_2d.shape[0])
                if not self._held.fits(bs):
                    self._write_held()
                self._held.add(target_hidden.view(bs, -1), cache_loc_2d, positions)
                return  # every row commits at q = 1 (no drafts): all of them are held
            prompt = self._prompt_append
            if (cache_loc_2d is None and prompt is not None
                    and prompt.fits(int(target_hidden.shape[0]))):  # a prefill's (flat) rows
                check = None if self._prompt_mode != "check" else (
                    self._draft_mr.token_to_kv_pool,
                    [layer.self_attn.attn.layer_id for layer in self.draft_model.layers])
                return append_prompt(prompt, super()._append_target_hidden_to_draft_kv_by_loc,
                                     check, target_hidden=target_hidden, cache_loc=cache_loc,
                                     positions=positions)
            stage = self._appends.get(self._q)
            if stage is None or not step:
                return super()._append_target_hidden_to_draft_kv_by_loc(
                    target_hidden=target_hidden, cache_loc=cache_loc, positions=positions,
                    cache_loc_2d=cache_loc_2d, commit_lens=commit_lens)
            bs, q = (int(n) for n in cache_loc_2d.shape)
            stage.run(target_hidden.view(bs, q, -1),  # [bs, q, h] the step's target hidden
                      cache_loc_2d, positions.view(bs, q), commit_lens)

        def _write_held(self) -> None:
            """The held q = 1 rows through DFLASH's own append, in one call."""
            got = self._held.take() if self._held is not None else None
            if got is not None:
                hidden, loc, pos = got
                DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc(
                    self, target_hidden=hidden, cache_loc=loc, positions=pos)

        def _use(self, q: int) -> None:
            if q == self._q:
                return
            self._states[self._q] = self._snapshot()  # keeps the buffers grown meanwhile
            st = self._states[q]
            for a in STATE_ATTRS:
                setattr(self, a, st[a])
            for key, mr in self._runners().items():
                for a in RUNNER_ATTRS:
                    setattr(mr, a, st[key][a])
            self._q = q

        def forward_batch_generation(self, batch, on_publish=None):
            extend = batch.forward_mode.is_extend() or batch.is_extend_in_batch
            decode = not (extend or batch.forward_mode.is_idle())
            now = time.perf_counter()  # this launch, for the ledger and the step clock
            if extend or decode:
                rows = getattr(batch, "seq_lens", None)  # [bs]
                self.ledger.launch(now, "d" if decode else "p", 0 if rows is None else len(rows))
            if not (decode and self._states):
                self._clock.reset()  # a prefill in between: no step time
                self._write_held()  # its slots may be a finished request's
                if extend and self._async_prefill:  # DFLASH's, without its host sync
                    return prefill(self, batch, on_publish)
                return super().forward_batch_generation(batch, on_publish=on_publish)
            bs = len(batch.seq_lens)
            q = self.policy.choose(bs)
            if self._held is not None:
                reqs = tuple(map(id, getattr(batch, "reqs", ()) or ()))
                if q > 1 or reqs != self._held_reqs or not reqs:
                    self._write_held()  # the drafter reads them / their slots may be freed
                self._held_reqs = reqs
            if sample := self._clock.launch(now, bs, q):
                self.policy.timed(*sample)
            self._use(q)
            self._issued.append((bs, q))
            self._steps[q] += 1
            n = sum(self._steps.values())
            if self._log_every and n % self._log_every == 0:  # warning: SGLang's level shows it
                logger.warning("%s: %d decode steps per block length %s; step ms now %s; "
                               "survival %s; launches %s; %s", NAME, n,
                               dict(sorted(self._steps.items())),
                               {c: {k: round(v, 2) for k, v in r.items()}
                                for c, r in self.policy.times().items()},
                               [round(v, 2) for v in self.policy.survival.values()[:8]],
                               self.ledger.summary(), memory_note())
            model, skip = self.target_worker.model_runner.model, contextlib.nullcontext()
            if q == 1 and self._no_noise is None:  # a table without `weight`: DFLASH's own
                embed = model.get_input_embeddings()
                self._no_noise = (BlockEmbeddingSkipped(embed, lambda: self._draft_block_ids_buf)
                                  if hasattr(embed, "weight") else False)
            if q == 1 and self._no_noise:
                skip = input_embeddings_as(model, self._no_noise)
            with skip:
                return super().forward_batch_generation(batch, on_publish=on_publish)

        def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size=0):
            if self._issued:
                bs, q = self._issued.popleft()
                self.policy.observe(bs, q, list(num_correct_drafts_per_req))

    return DFlashAdaptiveWorker
