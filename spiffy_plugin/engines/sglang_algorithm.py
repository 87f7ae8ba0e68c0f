"""Spiffy as an SGLang dLLM algorithm (imported lazily, inside SGLang processes only).

Each SGLang forward scores the root canvas of every request AND its D* draft canvases, in ONE
`model_runner.forward`: the drafts are extra sequences of the ForwardBatch whose req_to_token rows
share the request's committed-prefix KV slots and own fresh slots for their block
(`sglang_batch.py`). `step` then applies Spiffy's acceptance rule (`sglang_drafts.advance`, the
reference's replay), so one forward may advance several denoising steps, and greedy output stays
token-identical to `spiffy generate`. SGLang's own loops (`DllmAlgorithm._run_sync` / `_run_fdfo`)
drive the forwards unchanged: `run` hands them a `Scorer` in place of the model runner.
SGLang < 0.5.21 does not call `prepare_inputs` before a forward; there `run` and `step` hand the
Scorer the request states themselves (see `HANDS_STATES`).

Sampling: each request's temperature / top-p come from the batch's `sampling_info` (SGLang's
resolved `SamplingParams`, one row per root); a sampled request replays the same
`decode.step_distribution` / `choose_unmask` as the reference with its own random stream
(`sglang_drafts.Streams`: its `sampling_seed`, else the YAML `seed` and its request id). Greedy
requests (temperature 0, which SGLang stores as top_k 1) take the greedy path unchanged.
`validate_request` (SGLang >= 0.5.23) rejects, per request, sampling params we cannot honour.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Any

import torch
from sglang.srt.dllm.algorithm.base import DllmAlgorithm
from sglang.srt.dllm.config import DllmConfig

from ..errors import require
from ..params import DecodeParams
from .sglang import (
    copy_draft_kv,
    eager_dllm_unsupported,
    parse_spiffy_config,
    request_params,
    unsupported_sampling,
)
from .sglang_batch import DraftRows, extend_batch, unsupported
from .sglang_drafts import CanvasState, Draft, Streams, advance, drafts_to_score

logger = logging.getLogger(__name__)
# SGLang >= 0.5.21 calls `prepare_inputs(runner, batch, states)` before every forward of its loops.
HANDS_STATES = "prepare_inputs" in vars(DllmAlgorithm)
# rid -> the request's `sampling_seed`, noted by `validate_request` (the scheduler's process, the
# same as the model worker's) and taken when the request's random stream is created.
REQUEST_SEEDS: OrderedDict[Any, int] = OrderedDict()
MAX_PENDING_SEEDS = 65536


def kv_block_copier(pool):
    """`copy(tgt, src)` of K/V rows in SGLang's KV pool (all layers), or None where this pool's
    layout is not one we know to copy; then a final canvas gets its own forward, as in SGLang."""
    if getattr(pool, "_kv_copy_config", None) is not None or getattr(pool, "use_hnd", False):
        return pool.move_kv_cache  # SGLang's own copy is set up for this pool
    if (type(pool).__name__ == "MHATokenToKVPool" and getattr(pool, "kv_cache_layout", "") == "nhd"
            and getattr(pool, "k_scale_buffer", None) is None):
        from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

        return lambda tgt, src: move_kv_cache_native(pool.k_buffer, pool.v_buffer, tgt, src)
    return None


class Scorer:
    """Stands in for the model runner inside SGLang's dLLM loops: each `forward` is one forward
    of the real runner over the root rows plus the draft rows of `states`; the roots' logits go
    back to the loop, the drafts' stay here for `Spiffy.step`. Counts forwards."""

    def __init__(self, algo: Spiffy, model_runner):
        self.algo, self.mr = algo, model_runner
        self.rows = DraftRows(model_runner)
        self.states: list[CanvasState] = []
        self.scored: list[list[Draft]] = []  # per request: the drafts scored in this forward
        self.first: list[int] = []  # per request: its first draft row (index into self.rows)
        self.draft_logits: list[torch.Tensor | None] = []  # per request: [drafts, block, vocab]
        self.forwards = 0

    def forward(self, fb, pp_proxy_tensors=None):  # fb: input_ids [batch * block], the roots
        self.rows.release()  # the previous forward's rows (their K/V were used by its step)
        b, bs = fb.batch_size, self.algo.block_size
        canvases = fb.input_ids.view(b, bs).cpu()
        scored = [drafts_to_score(s, canvases[i]) for i, s in enumerate(self.states)]
        scored += [[] for _ in range(b - len(scored))]
        why = unsupported(fb, bs, self.mr.token_to_kv_pool_allocator.page_size)
        if why is not None:
            self.algo.warn_once(f"drafts not scored ({why}): one denoising step per forward")
            scored = [[] for _ in range(b)]
        wanted = sum(map(len, scored))
        left = self.rows.budget(b, bs) if wanted else 0
        if left < wanted:
            self.algo.warn_once(
                "not every draft fits this forward (free req_to_token rows / KV slots / "
                "--max-running-requests); a forward takes 1 + D* sequences per request: raise "
                "--max-running-requests and set max_running_requests in the YAML to the "
                "requests to denoise at once")
        for i in range(b):
            scored[i], left = scored[i][:left], left - min(left, len(scored[i]))
        owners = [i for i in range(b) for _ in scored[i]]
        batch = fb
        if owners and self.rows.allocate(len(owners), bs):
            ids = torch.stack([d.ids for s in scored for d in s])
            batch = extend_batch(fb, owners, ids, self.rows, bs)
        else:
            scored = [[] for _ in range(b)]
        first, row = [], 0
        for s in scored:  # per request: its first draft row (index into self.rows)
            first.append(row)
            row += len(s)
        with self.algo.forward_context(batch, scored, first, self.states):
            out = self.mr.forward(batch, pp_proxy_tensors=pp_proxy_tensors)
        self.forwards += 1
        logits = out.logits_output.full_logits
        self.scored, self.first, self.draft_logits, row = scored, first, [], b * bs
        for s in scored:
            self.draft_logits.append(logits[row: row + len(s) * bs].view(len(s), bs, -1)
                                     if s else None)
            row += len(s) * bs
        out.logits_output.full_logits = logits[: b * bs]
        return out


class Spiffy(DllmAlgorithm):
    """`--dllm-algorithm Spiffy --dllm-algorithm-config spiffy.yaml` (see the README)."""

    parse = staticmethod(parse_spiffy_config)
    # A draft row's K/V equal a dense forward's, so a final canvas's K/V may be copied from it.
    exact_draft_kv = True

    def __init__(self, config: DllmConfig):
        super().__init__(config)
        # copy only with SPIFFY_COPY_DRAFT_KV=1 (SpecFold's folded rows never copy)
        self.exact_draft_kv = type(self).exact_draft_kv and copy_draft_kv()
        self.cfg = self.parse(config.algorithm_config, block_size=config.block_size,
                              mask_id=config.mask_id)
        # forwards: all (prompt blocks too); blocks / steps / accepted: denoised blocks only
        self.totals = {"forwards": 0, "blocks": 0, "steps": 0, "accepted": 0}
        self._warned: set[str] = set()
        self._runner_checked = None  # the model runner `eager_dllm_unsupported` has passed
        self.streams = Streams(self.cfg.seed)
        logger.info("%s: graph %s (D=%d, D*=%d, rule %s); each forward scores the root and up "
                    "to D* draft blocks", type(self).__name__, self.cfg.graph_path,
                    self.cfg.budget, self.cfg.keep, self.cfg.graph.rule)

    @classmethod
    def configure_server_args(cls, server_args) -> None:
        """Fail at launch, before any model loads, on a bad algorithm config."""
        config = DllmConfig.from_server_args(server_args)
        cls.parse(config.algorithm_config, block_size=config.block_size, mask_id=config.mask_id)

    @classmethod
    def validate_request(cls, req) -> str | None:
        """Per request, at arrival (SGLang >= 0.5.23; a message aborts that request alone with
        HTTP 400): sampling params the reference cannot replay. Notes its `sampling_seed`."""
        sp = req.sampling_params
        why = unsupported_sampling(sp.top_k, sp.min_p)
        if why is not None:
            return why
        seed = getattr(sp, "sampling_seed", None)
        if seed is not None and sp.top_k > 1 and sp.temperature > 0:
            REQUEST_SEEDS[req.rid] = int(seed)
            while len(REQUEST_SEEDS) > MAX_PENDING_SEEDS:
                REQUEST_SEEDS.popitem(last=False)
        base = getattr(super(), "validate_request", None)
        return base(req) if base is not None else None

    def sampling(self, forward_batch) -> list[tuple[DecodeParams, int | None] | None]:
        """Per root row: (its DecodeParams, its own seed or None) when sampled, else None."""
        b = forward_batch.batch_size
        info = getattr(forward_batch, "sampling_info", None)
        if info is None or getattr(info, "is_all_greedy", False) \
                or getattr(info, "temperatures", None) is None:
            return [None] * b
        temps = info.temperatures.view(-1).tolist()
        top_ps, top_ks = info.top_ps.view(-1).tolist(), info.top_ks.view(-1).tolist()
        min_ps = info.min_ps.view(-1).tolist() if getattr(info, "min_ps", None) is not None \
            else [0.0] * len(temps)
        seeds = getattr(info, "sampling_seed", None)  # SGLang's deterministic inference only
        seeds = seeds.view(-1).tolist() if seeds is not None else [None] * len(temps)
        rids = list(forward_batch.rids or [None] * b)
        out: list[tuple[DecodeParams, int | None] | None] = []
        for i in range(b):
            if i >= len(temps):
                out.append(None)
                continue
            why = unsupported_sampling(top_ks[i], min_ps[i])
            if why is not None:  # SGLang < 0.5.23 has no per-request check
                self.warn_once(f"{why}: sampling with temperature and top_p only")
            params = request_params(self.cfg.params, temps[i], top_ps[i], top_ks[i])
            if params.greedy:
                out.append(None)
                continue
            own = REQUEST_SEEDS.pop(rids[i], None) if rids[i] is not None else None
            out.append((params, own if own is not None else seeds[i]))
        return out

    def forward_context(self, batch, scored: list[list[Draft]], first: list[int],
                        states: list[CanvasState]):
        """Entered around each model forward (`batch`: roots, then the draft rows); Spiffy's
        forward is SGLang's own (SpecFold folds inside it)."""
        return contextlib.nullcontext()

    def warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("%s: %s", type(self).__name__, message)

    def init_step_state(self, forward_batch) -> list[Any]:
        ids = forward_batch.input_ids.view(forward_batch.batch_size, self.block_size)
        prompt = getattr(forward_batch, "dllm_prompt_mask", None)  # SGLang >= 0.5.23
        prompt = prompt if prompt is not None else ids != self.mask_id
        return [CanvasState(p.cpu().clone()) for p in prompt]

    def run(self, model_runner, forward_batch, algo_states=None):
        """SGLang's own loop over a `Scorer`; draft rows are freed when it ends, errors too."""
        if self._runner_checked is not model_runner:  # once per runner, not every forward loop
            why = eager_dllm_unsupported(model_runner)
            require(why is None, "--attention-backend", why)
            self._runner_checked = model_runner
        self._scorer = Scorer(self, model_runner)
        if not HANDS_STATES and self.fdfo:  # the states SGLang's FDFO loop would build
            algo_states = self._carried_states(forward_batch, algo_states)
            self._scorer.states = algo_states
        try:
            return super().run(self._scorer, forward_batch, algo_states)
        finally:
            self._scorer.rows.release()
            self.totals["forwards"] += self._scorer.forwards

    def _carried_states(self, forward_batch, algo_states) -> list[Any]:
        """Each request's carried state, or a fresh one (as SGLang's `_run_fdfo` makes them)."""
        carried = algo_states or [None] * forward_batch.batch_size
        fresh = self.init_step_state(forward_batch) if None in carried else None
        return [fresh[i] if s is None else s for i, s in enumerate(carried)]

    def prepare_inputs(self, model_runner, forward_batch, states) -> None:
        if isinstance(model_runner, Scorer):
            model_runner.states = states

    def step(
        self,
        forward_batch,  # the roots' batch: input_ids [batch * block], advanced in place
        full_logits: torch.Tensor,  # [batch * block, vocab] the roots' logits
        states: list[Any],  # CanvasState per request
    ) -> list[bool]:  # per request: its final canvas's K/V are in the cache
        sc, bs, b = self._scorer, self.block_size, forward_batch.batch_size
        if not HANDS_STATES:  # for the loop's next forward (SGLang < 0.5.21)
            sc.states = states
        ids = forward_batch.input_ids.view(b, bs).cpu().clone()
        logits = full_logits.view(b, bs, -1)
        translator = getattr(sc.mr, "kv_index_translator", None)
        copy = None if getattr(translator, "is_translating", False) or not self.exact_draft_kv \
            else kv_block_copier(sc.mr.token_to_kv_pool)
        done = []
        sampled = self.sampling(forward_batch)
        starts = forward_batch.positions.view(b, bs)[:, 0].tolist() if any(sampled) else None
        rids = list(forward_batch.rids or [None] * b)
        for i, st in enumerate(states):
            if st.done:
                done.append(True)
                continue
            scored = sc.scored[i] if i < len(sc.scored) else []
            kw = {}
            if sampled[i] is not None:
                rid = rids[i] if rids[i] is not None else f"row{i}@{starts[i]}"
                kw = dict(params=sampled[i][0], generator=self.streams.get(
                    rid, logits.device, sampled[i][1], starts[i]))
            out = advance(ids[i], logits[i], scored, sc.draft_logits[i] if scored else None,
                          st, self.cfg, final_from_draft=copy is not None, **kw)
            if kw and out.done and self.cfg.eos_token_id is not None and \
                    (ids[i][~st.prompt.to(ids.device)] == self.cfg.eos_token_id).any():
                self.streams.drop(rid)  # the request ends with this block
            if out.kv_from is not None:  # the final canvas's K/V: copy the draft row's block
                root = forward_batch.out_cache_loc.view(b, bs)[i]
                copy(root, sc.rows.block_slots(sc.first[i] + out.kv_from, bs).to(root))
            if out.done:
                self._finished(forward_batch, i, st)
            done.append(out.done)
        forward_batch.input_ids.copy_(ids.view(-1).to(forward_batch.input_ids))  # in place
        return done

    def _finished(self, forward_batch, i: int, st: CanvasState) -> None:
        if st.steps == 0:  # a prompt block: nothing was denoised
            return
        for k, v in (("blocks", 1), ("steps", st.steps), ("accepted", st.accepted)):
            self.totals[k] += v
        rid = (forward_batch.rids or [None] * (i + 1))[i]
        # One-step decoding takes one forward per step plus the forward that persists the
        # final canvas's K/V: steps + 1 on the same (identical) trajectory.
        logger.info("Spiffy block: rid=%s forwards=%d steps=%d accepted=%d one_step_forwards=%d",
                    rid, st.forwards, st.steps, st.accepted, st.steps + 1)
