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
*Shared* (batch-wide) capacities size ONE compact batch for all requests of a forward: the plan
is over the sum of their counts, which spreads less than each request's maximum;
`BatchCapacityPlanner` makes it from the recompute shares seen per request (mean + z sd of the
sum), so it also serves a request count it has not seen. Overflow: same rule (re-run wider).
"""

from __future__ import annotations

import math

import torch
from specdec_kernels.sampling import ban_tokens

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


class BatchCapacityPlanner:
    """Plans shared capacities (rows of the whole batch) from the recompute shares (count / rows
    per request) of the last `window` forwards with the same (branches, positions), any number of
    requests. Per layer and gate, the sum over R requests of share x rows is planned as
    R x rows x mu + z x rows x sqrt(R^2 s_b^2 + R s_w^2) + margin x R x rows, rounded up to
    `granule`, at most every row: mu = mean share, s_w^2 = the spread between requests of one
    forward, s_b^2 = the spread of the forwards' mean shares beyond what s_w^2 explains (shared by
    all requests of a forward, so it does not average out). Until `min_seen` forwards: every
    row. A plan made from counts the decoder has seen (no oracle)."""
    shared = True

    def __init__(self, granule: int = 16, z: float = 3.0, margin: float = 0.0,
                 window: int = 16, min_seen: int = 2):
        require(granule >= 1, "granule", f"must be >= 1, got {granule}")
        require(z >= 0, "z", f"must be >= 0, got {z}")
        require(0 <= margin <= 1, "margin", f"must be in [0, 1], got {margin}")
        require(window >= 2, "window", f"must be >= 2, got {window}")
        require(1 <= min_seen <= window, "min_seen", f"must be in [1, {window}], got {min_seen}")
        self.granule, self.z, self.margin = granule, z, margin
        self.window, self.min_seen = window, min_seen
        self.seen: dict[tuple[int, int], list[torch.Tensor]] = {}  # [layers, 2, R] shares

    def plan(self, branches: int, n: int, layers: int, requests: int = 1) -> Caps:
        rows = branches * n
        full = requests * rows
        seen = self.seen.get((branches, n), [])
        if len(seen) < self.min_seen:
            return [(full, full)] * layers
        mu = torch.cat(seen, -1).mean(-1)  # [layers, 2]
        means = torch.stack([s.mean(-1) for s in seen])  # [forwards, layers, 2]
        wide = [s for s in seen if s.shape[-1] > 1]
        s_w2 = (torch.stack([s.var(-1) for s in wide]).mean(0) if wide
                else torch.zeros_like(mu))
        size = torch.tensor([s.shape[-1] for s in seen], dtype=mu.dtype)[:, None, None]
        s_b2 = ((means.var(0) - (s_w2 / size).mean(0)).clamp(min=0) if len(seen) > 1
                else torch.zeros_like(mu))
        sd = torch.sqrt(requests ** 2 * s_b2 + requests * s_w2)
        need = full * (mu + self.margin) + self.z * rows * sd
        caps = (torch.ceil(need / self.granule) * self.granule).clamp(self.granule, full)
        return [tuple(int(c) for c in lc) for lc in caps.tolist()]

    def update(self, branches: int, n: int, counts: torch.Tensor) -> None:
        """counts [layers, 2, requests] (host): every request's counts, as shares."""
        seen = self.seen.setdefault((branches, n), [])
        seen.append(counts.double() / (branches * n))
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
                   caps: Caps, ffn_gate: str = "own", shared: bool = False) -> int | None:
    """The first layer whose count (shared: the sum over requests) exceeded its planned
    capacity (None: the plan held; a capacity of None is sized at run time and never
    overflows)."""
    if shared:
        counts = counts.sum(-1, keepdim=True)
    cap = torch.tensor([[torch.iinfo(torch.int32).max if c is None else c for c in lc]
                        for lc in caps])[:, :, None]
    if ffn_gate == "layer":  # one compaction per layer, sized by the attention gate's plan
        cap = cap[:, :1].expand(-1, 2, -1)
    over = (counts > cap).flatten(1).any(1).nonzero()
    return int(over[0]) if len(over) else None


def folded_exact(model, batch: Batch, prefix: Prefix | None, delta: float, caps: Caps,
                 ffn_gate: str = "own", forced: list[tuple] | None = None,
                 shared: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> logits [T, vocab] fp32, counts [layers, 2, requests] int (host), layers re-run.
    One host sync (the counts); more only when the plan was too small. `shared`: caps are rows
    of ONE compact batch for all requests (batch-wide compaction), else rows per request."""
    layers = len(model.model.layers)
    full = batch.branches * batch.n * (batch.requests if shared else 1)
    require(len(caps) == layers, "caps", f"needs one entry per layer ({layers}), got {len(caps)}")
    bad = [c for lc in caps for c in lc if c is not None and not 1 <= c <= full]
    what = "rows of the batch" if shared else "rows per request"
    require(not bad, "caps", f"capacities must lie in [1, {full}] ({what}), got {bad[:3]}")
    h = model.model.embed_tokens(batch.ids)
    caps, start, rerun = list(caps), 0, 0
    inputs: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    while True:
        h, ins, cnt = run_layers(model, h, batch, prefix, delta, caps, ffn_gate, start, forced,
                                 shared)
        inputs, counts = inputs[:start] + ins, counts[:start] + cnt
        host = torch.stack(counts).cpu()  # [layers, 2, requests]: the one sync
        start = first_overflow(host, caps, ffn_gate, shared)
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
    planner: CapacityPlanner | BatchCapacityPlanner | SyncCapacities | None = None,
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
                                         ffn_gate, shared=getattr(planner, "shared", False))
    if planner is not None:
        planner.update(k, n, counts)
    if stats is not None:
        stats.add_forward(k * n, n, runner.cached)
        stats.reruns += rerun
        for i, (qkv, ffn) in enumerate(counts[:, :, 0].tolist()):
            stats.add_layer(i, qkv, ffn, runner.cached)
    logits = logits.view(k, n, -1)
    ban_tokens(logits, runner.spec.banned_token_ids)
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
    ban_tokens(logits, runner.spec.banned_token_ids)
    runner.nfe += 1
    return logits
