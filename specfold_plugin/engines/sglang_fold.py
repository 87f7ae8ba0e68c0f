"""SpecFold's folded SDAR decoder layer inside SGLang's forward (duck-typed; imported lazily).

A *fold plan* is active (`active(batch, plan)`, a context variable, around one model forward
whose ForwardBatch holds draft rows): per request, the batch sequences of its tree (root first)
and each one's parent branch. The plan cannot ride on the ForwardBatch itself: SGLang's eager
runner hands the layers a copy of it (`EagerRunner.load_batch`). `fold_forward`, an AROUND hook
on `SDARBlock.forward` in SGLang's `HookRegistry` (`register_fold_hook`, run by SpecFold's entry
point), makes every SDAR layer whose batch has the shape of the active plan run `folded_block`:
the gate of the reference
(`specfold_plugin.gate`) on the layer input picks the recompute rows; qkv_proj (+ q/k norm, rope)
runs on those only and folded rows copy their source's Q/K/V; SGLang's own RadixAttention then
runs over every row (K/V writes and prefix sharing stay SGLang's); the FFN is gated the same way
on its own input. On any other batch (no plan: Spiffy, other algorithms, prompt blocks, CUDA-graph
capture) the layer's own forward runs unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

from spiffy_plugin.errors import require

from ..gate import gate, resolve_sources, source_rows
from ..stats import FoldStats


@dataclass
class Group:
    seqs: torch.Tensor  # [k] long: batch sequence of each branch, the root first
    parents: torch.Tensor  # [k] long: parent branch (index into seqs), parents[0] = -1
    stats: FoldStats | None = None  # this request's counters (rows of its k sequences)


@dataclass
class FoldPlan:
    sequences: int  # sequences of the ForwardBatch (roots and draft rows)
    block: int  # tokens per sequence
    delta: float
    groups: list[Group]
    ffn_gate: str = "own"  # "own": FFN gated on its own input; "layer": the attention gate's set
    stats: FoldStats | None = None  # counters over every sequence of the forward
    layers_run: int = 0  # wrapped layers that ran folded under this plan
    record: list | None = None  # when a list: per layer (qkv fold [S, n], ffn fold [S, n]) bool
    _layer: int = field(default=0, repr=False)


SDAR_FORWARD = "sglang.srt.models.sdar.SDARBlock.forward"  # the HookRegistry target
# The plan of the model forward running now in this thread / task (None outside one).
_PLAN: contextvars.ContextVar[FoldPlan | None] = contextvars.ContextVar("specfold_plan",
                                                                          default=None)


@contextlib.contextmanager
def active(forward_batch, plan: FoldPlan):
    """Fold the forward of `forward_batch` (the batch of `plan.sequences` sequences) run inside
    this block with `plan`."""
    require(forward_batch.batch_size == plan.sequences, "FoldPlan.sequences",
            f"{plan.sequences} for a batch of {forward_batch.batch_size} sequences")
    token = _PLAN.set(plan)
    try:
        yield plan
    finally:
        _PLAN.reset(token)


def plan_of(forward_batch, positions: torch.Tensor) -> FoldPlan | None:  # positions [S * n]
    """The active plan, when this batch has its shape (else None: another forward)."""
    plan = _PLAN.get()
    if plan is None or forward_batch.batch_size != plan.sequences \
            or positions.shape[0] != plan.sequences * plan.block:
        return None
    return plan


def fold_rows(
    h: torch.Tensor,  # [S * n, d] sublayer input of every sequence of the batch
    plan: FoldPlan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # rows [R], take [S*n], fold [S, n] bool
    """Recompute rows (flat indices) and, per row, the index into them of its source."""
    s, n = plan.sequences, plan.block
    hv = h.view(s, n, -1)
    sources = torch.arange(s, device=h.device)[:, None].repeat(1, n)  # [S, n]
    fold = torch.zeros(s, n, dtype=torch.bool, device=h.device)
    for g in plan.groups:
        seqs, par = g.seqs.to(h.device), g.parents.to(h.device)
        f = gate(hv[seqs], par, plan.delta)  # [k, n]
        sources[seqs] = seqs[resolve_sources(f, par)]
        fold[seqs] = f
    rows, take = source_rows(sources, ~fold)
    return rows, take, fold


def _count(plan: FoldPlan, qkv_fold: torch.Tensor, ffn_fold: torch.Tensor,  # [S, n] bool
           qkv_rows: int, ffn_rows: int) -> None:
    """Per-layer counters: recomputed rows of the whole forward (the compact batches' sizes,
    already on the host) and of each request (one device-to-host read for all requests)."""
    layer = plan._layer
    if plan.stats is not None:
        plan.stats.add_layer(layer, qkv_rows, ffn_rows, 0)
    counted = [g for g in plan.groups if g.stats is not None]
    if counted:
        dev = qkv_fold.device
        per = torch.stack([torch.stack([(~qkv_fold[g.seqs.to(dev)]).sum(),
                                        (~ffn_fold[g.seqs.to(dev)]).sum()])
                           for g in counted]).tolist()  # [groups, 2]
        for g, (q, f) in zip(counted, per):
            g.stats.add_layer(layer, q, f, 0)
    if plan.record is not None:
        plan.record.append((qkv_fold.cpu(), ffn_fold.cpu()))
    plan._layer += 1
    plan.layers_run += 1


def folded_block(
    layer,  # sglang.srt.models.sdar.SDARBlock
    positions: torch.Tensor,  # [S * n]
    hidden_states,  # the stream's layer output handle (SGLang's residual boundary)
    forward_batch,
    plan: FoldPlan,
):
    """`SDARBlock.forward` with SpecFold's gates (see the module docstring)."""
    from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
    from sglang.srt.models.utils import apply_qk_norm

    attn = layer.self_attn
    x = layer.attn_boundary.prepare(hidden_states, forward_batch)  # [S*n, d] normed input
    h = residual_batch.written_residual(forward_batch)  # [S*n, d] the layer's input stream
    h = x if h is None else h
    rows, take, qfold = fold_rows(h, plan)
    qkv, _ = attn.qkv_proj(x[rows])  # [R, q + 2 kv]
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k = apply_qk_norm(q=q, k=k, q_norm=attn.q_norm, k_norm=attn.k_norm,
                         head_dim=attn.head_dim, alt_stream=attn.alt_stream)
    q, k = attn.rotary_emb(positions[rows], q, k)
    ctx = attn.attn(q[take], k[take], v[take].contiguous(), forward_batch, save_kv_cache=True)
    out, _ = attn.o_proj(ctx)
    out = layer.attn_boundary.finish(out, forward_batch)
    x = layer.ffn_boundary.prepare(out, forward_batch)  # [S*n, d] normed FFN input
    if plan.ffn_gate == "layer":
        frows, ftake, ffold = rows, take, qfold
    else:
        mid = residual_batch.written_residual(forward_batch)  # [S*n, d] FFN input stream
        frows, ftake, ffold = fold_rows(x if mid is None else mid, plan)
    y = layer.mlp(x[frows])[ftake]  # [S*n, d]
    _count(plan, qfold, ffold, len(rows), len(frows))
    return layer.ffn_boundary.finish(y, forward_batch)


def sdar_blocks(model) -> list:
    """The SDARBlock layers of an SGLang SDAR model ([] for any other model)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return [m for m in layers if type(m).__name__ == "SDARBlock"
            and type(m).__module__ == "sglang.srt.models.sdar"]


def has_layer_boundary(block) -> bool:
    """SGLang >= 0.5.21's SDARBlock (`attn_boundary`/`ffn_boundary`, forward without residual),
    the layout `folded_block` is written for; older ones use a `layer_communicator`."""
    return hasattr(block, "attn_boundary") and hasattr(block, "ffn_boundary")


def fold_forward(original, layer, positions, hidden_states, forward_batch):
    """AROUND hook on `SDARBlock.forward`: `folded_block` under this batch's plan, else the
    layer's own forward."""
    plan = plan_of(forward_batch, positions)
    if plan is None:
        return original(layer, positions, hidden_states, forward_batch)
    return folded_block(layer, positions, hidden_states, forward_batch, plan)


def register_fold_hook() -> None:
    """Register `fold_forward` in SGLang's HookRegistry (applied by SGLang's `load_plugins`
    after the entry points ran). For SGLang >= 0.5.21 (layer-boundary SDAR layers) only."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SDAR_FORWARD, fold_forward, HookType.AROUND)


def fold_hook_applied() -> bool:
    """Whether `fold_forward` wraps `SDARBlock.forward` in this process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks = HookRegistry._hooks.get(SDAR_FORWARD, ())
    return SDAR_FORWARD in HookRegistry._patched and any(h is fold_forward for _, h, _ in hooks)


def foldable_layers(model) -> int:
    """SDAR layers of `model` that fold: those with the layer-boundary API `folded_block` is
    written for (0 for another model or an older SDAR layer)."""
    return sum(has_layer_boundary(m) for m in sdar_blocks(model))
