"""SpecFold's folded verify forward on the Triton kernels (backend "triton"; `fold.py` is the spec).

*Capacity plan*: per layer, the compact rows per request given to the attention gate and to the
FFN gate (a static size; `fast_layers`). Inside the layer loop nothing syncs with the host. After
the forward, ONE host read takes every layer's true counts (the stats need them anyway); a layer
whose count exceeded its capacity makes the forward re-run from that layer with full capacity, so
results never depend on the plan, only the time does. `CapacityPlanner` sizes each forward's plan
from the largest counts of the last few forwards with the same number of branches (plus a margin,
rounded up to a granule): one full-size forward per branch count, then mostly tight plans.
`SyncCapacities` instead leaves every capacity None: each gate reads its true count on the host
and compacts into exactly that (rounded up), so nothing re-runs, but the forward syncs twice per
layer and cannot be captured in a CUDA graph (the default of the eager decoding loop).
"""

from __future__ import annotations

import math

import torch

from spiffy_plugin.errors import require
from spiffy_plugin.runtime import BlockDiffusionRunner

from .fast_layers import Batch, Prefix, logits_of, prepare, run_layers, runner_prefix
from .fold import check_fold_args
from .stats import FoldStats

# [layers] (attention gate, FFN gate) compact rows per request; None = sized at run time (sync)
Caps = list[tuple[int | None, int | None]]


class CapacityPlanner:
    """Plans from the counts seen at the same (branches, positions): per layer and gate, the
    largest of the last `window` counts + margin x rows, rounded up to `granule`, at most every
    row. (A replay of the fixture's counts, BENCHMARKS.md "SpecFold": window 8 re-runs 2.9 % of the
    layers at delta 0.05 where window 1 re-ran 14.9 %, and plans 2.6 % fewer rows.)"""

    def __init__(self, granule: int = 16, margin: float = 0.125, window: int = 8):
        require(granule >= 1, "granule", f"must be >= 1, got {granule}")
        require(0 <= margin <= 1, "margin", f"must be in [0, 1], got {margin}")
        require(window >= 1, "window", f"must be >= 1, got {window}")
        self.granule, self.margin, self.window = granule, margin, window
        self.seen: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}

    def plan(self, branches: int, n: int, layers: int) -> Caps:
        full = branches * n
        seen = self.seen.get((branches, n))
        if not seen:
            return [(full, full)] * layers
        pad = self.margin * full
        top = [tuple(map(max, zip(*layer))) for layer in zip(*seen)]  # [layers] (qkv, ffn)
        return [tuple(min(full, math.ceil((c + pad) / self.granule) * self.granule) for c in lc)
                for lc in top]

    def update(self, branches: int, n: int, counts: torch.Tensor) -> None:
        """counts [layers, 2, requests] (host): the largest request counts for the plan."""
        seen = self.seen.setdefault((branches, n), [])
        seen.append([tuple(int(x) for x in lc) for lc in counts.amax(-1)])
        del seen[: -self.window]


class SyncCapacities:
    """The `sync` plan: every gate sizes its compact batch from its true count (a host read per
    gate, never a re-run, not capturable in a CUDA graph). Planned capacities pad each gate by
    the margin and by the spread of recent counts; this pads only to the granule."""

    def plan(self, branches: int, n: int, layers: int) -> Caps:
        return [(None, None)] * layers

    def update(self, branches: int, n: int, counts: torch.Tensor) -> None:
        pass


def first_overflow(counts: torch.Tensor,  # [layers, 2, requests] true counts (host)
                   caps: Caps, ffn_gate: str = "own") -> int | None:
    """The first layer whose count exceeded its planned capacity (None: the plan held; a
    capacity of None is sized at run time and never overflows)."""
    cap = torch.tensor([[torch.iinfo(torch.int32).max if c is None else c for c in lc]
                        for lc in caps])[:, :, None]
    if ffn_gate == "layer":  # one compaction per layer, sized by the attention gate's plan
        cap = cap[:, :1].expand(-1, 2, -1)
    over = (counts > cap).flatten(1).any(1).nonzero()
    return int(over[0]) if len(over) else None


def folded_exact(model, batch: Batch, prefix: Prefix | None, delta: float, caps: Caps,
                 ffn_gate: str = "own", forced: list[tuple] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> logits [T, vocab] fp32, counts [layers, 2, requests] int (host), layers re-run.
    One host sync (the counts); more only when the plan was too small."""
    layers = len(model.model.layers)
    full = batch.branches * batch.n
    require(len(caps) == layers, "caps", f"needs one entry per layer ({layers}), got {len(caps)}")
    bad = [c for lc in caps for c in lc if c is not None and not 1 <= c <= full]
    require(not bad, "caps", f"capacities must lie in [1, {full}] (rows per request), got "
            f"{bad[:3]}")
    h = model.model.embed_tokens(batch.ids)
    caps, start, rerun = list(caps), 0, 0
    inputs: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    while True:
        h, ins, cnt = run_layers(model, h, batch, prefix, delta, caps, ffn_gate, start, forced)
        inputs, counts = inputs[:start] + ins, counts[:start] + cnt
        host = torch.stack(counts).cpu()  # [layers, 2, requests]: the one sync
        start = first_overflow(host, caps, ffn_gate)
        if start is None:
            return logits_of(model, h), host, rerun
        rerun += layers - start
        caps[start:] = [(full, full)] * (layers - start)
        h = inputs[start]


@torch.inference_mode()
def folded_forward_fast(
    runner: BlockDiffusionRunner,
    blocks: torch.Tensor,  # [k, block_size] ids: branch 0 = the root, then the drafts
    parents: list[int],  # [k] parent branch of each, parents[0] = -1
    delta: float,
    stats: FoldStats | None = None,
    ffn_gate: str = "own",
    planner: CapacityPlanner | SyncCapacities | None = None,
) -> torch.Tensor:  # [k, block_size, vocab] fp32 logits (one NFE)
    """`fold.folded_forward` on the kernels: same arguments, same result (within fp32
    tolerance); `planner` sizes the compact batches (None: every row, i.e. no saving)."""
    delta = check_fold_args(blocks, parents, delta, ffn_gate)
    k, n = blocks.shape
    require(n == runner.spec.block_size, "blocks", f"blocks of {runner.spec.block_size} tokens "
            f"expected, got {n}")
    model = runner.model
    layers = len(model.model.layers)
    batch = prepare(model, blocks[None], parents, [runner.cached])
    caps = planner.plan(k, n, layers) if planner is not None else [(k * n, k * n)] * layers
    logits, counts, rerun = folded_exact(model, batch, runner_prefix(runner), delta, caps,
                                         ffn_gate)
    if planner is not None:
        planner.update(k, n, counts)
    if stats is not None:
        stats.add_forward(k * n, n, runner.cached)
        stats.reruns += rerun
        for i, (qkv, ffn) in enumerate(counts[:, :, 0].tolist()):
            stats.add_layer(i, qkv, ffn, runner.cached)
    logits = logits.view(k, n, -1)
    if runner.spec.banned_token_ids:
        logits[..., list(runner.spec.banned_token_ids)] = float("-inf")
    runner.nfe += 1
    return logits


@torch.inference_mode()
def dense_forward_fast(runner: BlockDiffusionRunner,
                       blocks: torch.Tensor,  # [k, block_size]
                       ) -> torch.Tensor:  # [k, block_size, vocab] fp32
    """Spiffy's dense verification on the same kernels (every row recomputed; the baseline the
    folded path is timed against). Caches nothing."""
    k, n = blocks.shape
    model = runner.model
    batch = prepare(model, blocks[None], [-1] * k, [runner.cached])
    h, _, _ = run_layers(model, model.model.embed_tokens(batch.ids), batch,
                         runner_prefix(runner), None, None)
    logits = logits_of(model, h).view(k, n, -1)
    if runner.spec.banned_token_ids:
        logits[..., list(runner.spec.banned_token_ids)] = float("-inf")
    runner.nfe += 1
    return logits
