"""SpecFold decoding: Spiffy's drafting and acceptance with the folded verify forward.

Drafts, pruning and the acceptance replay are Spiffy's (`spiffy_plugin.spiffy`); only the verify
forward changes (`fold.folded_forward`). The root is never folded, so the first step of every
forward is exact; a draft's logits are approximate for delta > 0, so the output can differ from
Spiffy's (= vanilla decoding's): *agreement* is measured, not assumed. delta = 0 is exact.
*Backend*: "torch" = `fold.folded_forward` (the reference), "triton" = `fold_fast` (the same
forward on the `kernels` ops; on CPU only under TRITON_INTERPRET=1).
*Capacity* (backend "triton"): "sync" (default; this decoding loop is eager) = each gate's
compact batch sized from its true count (a host read per gate, padding below 16 rows, never a
re-run); "plan" = sized from recent forwards' counts (`fold_fast.CapacityPlanner`: no host read
inside the layer loop, as a CUDA graph needs; a too-small plan re-runs layers). On the H200, 16
fixture prompts, sync decoded 1.16x / 1.06x faster than plan at delta 0.05 / 0.1 (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spiffy_plugin.decode import DLLMResult
from spiffy_plugin.errors import require
from spiffy_plugin.graph import DraftGraph
from spiffy_plugin.params import DecodeParams
from spiffy_plugin.runtime import BlockDiffusionRunner
from spiffy_plugin.spiffy import spiffy_generate

from .fold import FFN_GATES, GateFn, folded_forward
from .gate import check_delta, gate
from .stats import FoldStats

DEFAULT_DELTA = 0.1
BACKENDS = ("torch", "triton")
CAPACITIES = ("plan", "sync")


class FoldedVerify:
    """A `spiffy_plugin.spiffy.Verify` that folds, accumulating `stats` over its forwards."""

    def __init__(self, delta: float = DEFAULT_DELTA, ffn_gate: str = "own",
                 gate_fn: GateFn = gate, backend: str = "torch", capacity: str = "sync"):
        self.delta = check_delta(delta)
        require(ffn_gate in FFN_GATES, "ffn_gate", f"must be one of {FFN_GATES}, got "
                f"{ffn_gate!r}")
        require(backend in BACKENDS, "backend", f"must be one of {BACKENDS}, got {backend!r}")
        require(backend == "torch" or gate_fn is gate, "gate_fn", "a custom gate needs the "
                "torch backend")
        require(capacity in CAPACITIES, "capacity", f"must be one of {CAPACITIES}, got "
                f"{capacity!r}")
        self.ffn_gate, self.gate_fn, self.backend = ffn_gate, gate_fn, backend
        self.stats: FoldStats | None = None
        self.planner = None
        if backend == "triton":
            from .fold_fast import CapacityPlanner, SyncCapacities  # imports triton
            self.planner = CapacityPlanner() if capacity == "plan" else SyncCapacities()

    def __call__(self, runner: BlockDiffusionRunner, blocks: torch.Tensor,  # [k, block_size]
                 parents: list[int]) -> torch.Tensor:  # [k, block_size, vocab]
        if self.stats is None:
            self.stats = FoldStats(len(runner.model.model.layers))
        if self.backend == "triton":
            from .fold_fast import folded_forward_fast
            return folded_forward_fast(runner, blocks, parents, self.delta, self.stats,
                                       self.ffn_gate, self.planner)
        return folded_forward(runner, blocks, parents, self.delta, self.stats, self.ffn_gate,
                              self.gate_fn)


@dataclass
class SpecFoldResult(DLLMResult):
    fold: FoldStats | None = None  # None when no verification forward had drafts


@torch.inference_mode()
def specfold_generate(model, prompt: list[int], graph: DraftGraph,
                      params: DecodeParams = DecodeParams(), max_new_tokens: int = 128,
                      keep: int | None = None, delta: float = DEFAULT_DELTA,
                      ffn_gate: str = "own", backend: str = "torch",
                      capacity: str = "sync") -> SpecFoldResult:
    """Spiffy decoding with folded verification (bad delta / ffn_gate / backend / capacity fail
    before any work)."""
    verify = FoldedVerify(delta, ffn_gate, backend=backend, capacity=capacity)
    res = spiffy_generate(model, prompt, graph, params, max_new_tokens, keep, verify=verify)
    return SpecFoldResult(res.tokens, res.nfe, res.steps, res.stop_reason, verify.stats)


def token_agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(positions where the two outputs hold the same token, length of the longer)."""
    return sum(x == y for x, y in zip(a, b)), max(len(a), len(b))


def agreement_summary(outs: list[list[int]], refs: list[list[int]]) -> dict:
    """Over many prompts: share of tokens equal at the same index (`token_agreement`, summed),
    prompts with identical outputs, prompts."""
    pairs = [token_agreement(a, b) for a, b in zip(outs, refs)]
    total = sum(t for _, t in pairs)
    return {"agreement": round(sum(s for s, _ in pairs) / total, 4) if total else 1.0,
            "identical_prompts": sum(a == b for a, b in zip(outs, refs)), "prompts": len(refs)}
