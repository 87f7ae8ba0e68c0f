"""SpecFold as an SGLang dLLM algorithm (imported lazily, inside SGLang processes only).

Spiffy's algorithm (`spiffy_plugin.engines.sglang_algorithm`: drafts as extra sequences of the
root's forward, Spiffy's acceptance replay) with a folded verify forward: around every forward that
holds draft rows a fold plan is active (`sglang_fold.py`), under which each SDAR decoder layer
computes QKV and the FFN only for the (draft row, position) rows the residual gate recomputes
(delta = 0: only exact repeats of the parent branch fold, so the output is Spiffy's). Attention
runs for every row in SGLang's backend. Fold counters are logged per finished block. For delta > 0
no final canvas's K/V are copied from a (folded) draft row: the committed cache stays exact.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from spiffy_plugin.engines.sglang_algorithm import Spiffy
from spiffy_plugin.engines.sglang_drafts import CanvasState
from spiffy_plugin.engines.versions import LEGACY_SPECFOLD, describe, installed
from spiffy_plugin.spiffy import branch_parents

from ..stats import FoldStats
from .sglang import parse_specfold_config
from .sglang_fold import FoldPlan, Group, active, fold_hook_applied, foldable_layers, sdar_blocks

logger = logging.getLogger(__name__)
DUMPS = 3


def _parse(raw, *, block_size: int, mask_id: int):
    return parse_specfold_config(raw, block_size=block_size, mask_id=mask_id).spiffy


@dataclass
class FoldState(CanvasState):
    fold: FoldStats | None = None  # this block's fold counters (forwards with drafts only)


class SpecFold(Spiffy):
    parse = staticmethod(_parse)

    def __init__(self, config):
        super().__init__(config)
        self.delta = parse_specfold_config(config.algorithm_config, block_size=config.block_size,
                                           mask_id=config.mask_id).delta
        # delta > 0: folded draft rows hold approximate K/V, so a final canvas is persisted by
        # SGLang's own forward (dense, as the reference commits it), never copied from a draft
        # (nor with SPIFFY_COPY_DRAFT_KV=0, read by Spiffy's __init__).
        self.exact_draft_kv = self.exact_draft_kv and self.delta == 0
        self.layers = 0  # wrapped SDAR layers (0 until the first run, or on another model)
        self.fold: FoldStats | None = None  # over every forward with drafts
        # Verification aid: SPECDEC_SPECFOLD_DUMP=DIR saves the first DUMPS forwards with drafts
        # (ids, positions, tree, per-layer fold sets, logits) for comparison with the reference.
        self.dump_dir = os.environ.get("SPECDEC_SPECFOLD_DUMP")
        self.dumped = 0
        self._pending: dict | None = None

    def run(self, model_runner, forward_batch, algo_states=None):
        if not self.layers:
            self.layers = foldable_layers(model_runner.model)
            if self.layers and not fold_hook_applied():
                self.layers = 0
                self.warn_once("the SDAR layer hook is not applied in this process (SpecFold "
                               "registered outside SGLang's plugin loading?): drafts are scored "
                               "densely")
            elif self.layers:
                self.fold = FoldStats(self.layers)
                logger.info("SpecFold: folding %d SDAR layers (delta=%g)", self.layers,
                            self.delta)
            elif sdar_blocks(model_runner.model):  # SGLang < 0.5.21 (see versions.py)
                self.warn_once(LEGACY_SPECFOLD % describe(installed("sglang")))
            else:
                self.warn_once(f"folding needs SGLang's SDAR model, got "
                               f"{type(model_runner.model).__name__}: drafts are scored densely")
        return super().run(model_runner, forward_batch, algo_states)

    def init_step_state(self, forward_batch) -> list[FoldState]:
        return [FoldState(s.prompt) for s in super().init_step_state(forward_batch)]

    def forward_context(self, batch, scored, first, states):
        b, bs = len(scored), self.block_size
        if not self.layers or not any(scored):
            return contextlib.nullcontext()
        groups = []
        for i, s in enumerate(scored):
            if not s:
                continue
            st = states[i] if i < len(states) else None
            if isinstance(st, FoldState) and st.fold is None:
                st.fold = FoldStats(self.layers)
            stats = st.fold if isinstance(st, FoldState) else None
            if stats is not None:
                stats.add_forward((1 + len(s)) * bs, bs, 0)
            seqs = [i] + [b + first[i] + j for j in range(len(s))]
            par = branch_parents(self.cfg.graph, [d.node for d in s])
            groups.append(Group(torch.tensor(seqs), torch.tensor(par), stats))
        self.fold.add_forward(batch.batch_size * bs, b * bs, 0)
        plan = FoldPlan(batch.batch_size, bs, self.delta, groups, stats=self.fold)
        rids = list(batch.rids or [])[:b]
        if self.dump_dir and self.dumped < DUMPS and not any(
                str(r).startswith("HEALTH_CHECK") for r in rids):  # SGLang's own probes
            plan.record = []
            self._pending = {"plan": plan, "rids": rids, "input_ids": batch.input_ids.cpu().clone(),
                             "positions": batch.positions.cpu().clone()}
        return self._checked(batch, plan)

    def step(self, forward_batch, full_logits, states):
        if self._pending is not None:
            self._dump(self._pending, full_logits)
            self._pending = None
        return super().step(forward_batch, full_logits, states)

    def _dump(self, pending: dict, full_logits: torch.Tensor) -> None:  # [batch * block, vocab]
        plan, sc, bs = pending.pop("plan"), self._scorer, self.block_size
        roots = full_logits.view(-1, bs, full_logits.shape[-1])
        drafts = [torch.cat([roots[i: i + 1], d]) if d is not None else roots[i: i + 1]
                  for i, d in enumerate(sc.draft_logits)]
        pending.update(
            groups=[(g.seqs, g.parents) for g in plan.groups], delta=plan.delta,
            fold=plan.record, logits=[d.float().cpu() for d in drafts])  # per request [k, n, V]
        Path(self.dump_dir).mkdir(parents=True, exist_ok=True)
        torch.save(pending, Path(self.dump_dir) / f"forward{self.dumped}.pt")
        self.dumped += 1

    @contextlib.contextmanager
    def _checked(self, batch, plan: FoldPlan):
        with active(batch, plan):
            yield
        if plan.layers_run != self.layers:
            self.warn_once(f"only {plan.layers_run} of {self.layers} layers ran folded in a "
                           "forward with drafts (a graph replay or another model path)")

    def _finished(self, forward_batch, i: int, st: CanvasState) -> None:
        super()._finished(forward_batch, i, st)
        if st.steps == 0 or not isinstance(st, FoldState) or st.fold is None:
            return
        rid = (forward_batch.rids or [None] * (i + 1))[i]
        f = st.fold
        logger.info("SpecFold block: rid=%s fold_forwards=%d fold_qkv=%.4f fold_ffn=%.4f "
                    "fold_qkv_drafts=%.4f fold_ffn_drafts=%.4f", rid, f.forwards,
                    f.fold_ratio("qkv"), f.fold_ratio("ffn"), f.fold_ratio("qkv", True),
                    f.fold_ratio("ffn", True))
