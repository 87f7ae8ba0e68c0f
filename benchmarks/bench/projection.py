"""Isolated CUDA-graph timings of the fast runtime's steps, and the Qwen3-8B-shape projection.

T(q) = one target verify forward of q query tokens per row (graph replay, context of `ctx`
committed tokens); T_draft(q) = one drafter block forward + LM head; `accept_times` = the
acceptance step, eager vs compiled. The projection is the speedup implied by an acceptance length
tau: tau * T(1) / (T(B) + T_draft(B)). Random weights: only the shapes matter for time. Used
by `gpu_speedup.py` and `fast_attention_bench.py`; the projection alone (tau 3.0 unless DFlash
batch-1 rows run too, whose tau it then takes):
    python benchmarks/gpu_speedup.py --out OUT --rows 8b
`tree_8b`: the same for tree rounds (`fast.tree_loop`): verify of anchor + N nodes and draft +
tree build per node budget at the 8B shape, and the speedup over the linear block implied by
the taus of the fixture's tree rows (`gpu_speedup.py --rows tree --tree-8b`).
"""

from __future__ import annotations

import gc

import torch

from dflash_plugin.config import build_target_layer_ids
from dflash_plugin.fast.accept import accept_round
from dflash_plugin.fast.drafter import random_drafter
from dflash_plugin.fast.graphs import time_step
from dflash_plugin.fast.loop import FastDecoder
from dflash_plugin.fast.qwen3 import Shape, random_target
from dflash_plugin.fast.tree_loop import TreeDecoder

QWEN3_8B = Shape(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                 vocab=151936, theta=1_000_000.0)


@torch.inference_mode()
def step_times(dec: FastDecoder, qs: list[int], iters: int = 50) -> dict:
    """{"verify": {q: ms}, "draft": {q: ms}} of an already prefilled/positioned decoder.
    Verify/draft only write stale cache slots and output buffers, so repeating them is safe."""
    dev = dec.device
    out = {"verify": {}, "draft": {}}
    for q in qs:
        out["verify"][q] = time_step(lambda q=q: dec._verify(q), dev, iters)
        if dec.drafter is not None and q > 1:
            out["draft"][q] = time_step(lambda q=q: dec._draft(q), dev, iters)
    return out


def accept_times(dec, q: int) -> dict:
    """Graph-timed acceptance step, eager and compiled (`fast.accept.accept_round`). Every row is
    marked finished first, so the step commits nothing and can be repeated (same kernels)."""
    dec.done.fill_(True)
    args = dec.accept_args(q)
    compiled = torch.compile(accept_round, dynamic=True)
    return {"accept_eager_ms": time_step(lambda: accept_round(*args), dec.device),
            "accept_compiled_ms": time_step(lambda: compiled(*args), dec.device)}


def random_pair(shape: Shape, draft_layers: int, device: str):
    """A bf16 target of `shape` and a DFlash drafter of `draft_layers` for it, random weights."""
    dtype = torch.bfloat16
    tw = random_target(shape, dtype, device)
    dshape = Shape(shape.hidden, draft_layers, shape.heads, shape.kv_heads, shape.head_dim,
                   shape.intermediate, shape.vocab, theta=shape.theta)
    ids = tuple(build_target_layer_ids(shape.layers, draft_layers))
    return tw, random_drafter(dshape, shape.hidden, ids, dtype, device)


@torch.inference_mode()
def project_8b(taus: dict[str, float], ctx: int = 1024, draft_layers: int = 5,
               device: str = "cuda", iters: int = 50, shape: Shape = QWEN3_8B,
               attention: str = "sdpa") -> dict:
    tw, dw = random_pair(shape, draft_layers, device)
    res = {"shape": shape.__dict__, "draft_layers": draft_layers, "context": ctx,
           "attention": attention}
    times = {}
    for name, drafter, qs in (("ar", None, [1]), ("dflash", dw, [8, 16])):
        dec = FastDecoder(tw, drafter, 1, ctx + 64, device, max_block=16, attention=attention)
        dec.tcache.reset(torch.tensor([ctx], device=device))
        times[name] = step_times(dec, qs, iters)
        del dec
    t1 = times["ar"]["verify"][1]
    res["verify_ms"] = {1: t1, **times["dflash"]["verify"]}
    res["draft_ms"] = times["dflash"]["draft"]
    res["projection"] = {}
    for label, tau in taus.items():
        b = 8 if label.endswith("B8") else 16
        denom = res["verify_ms"][b] + res["draft_ms"][b]
        res["projection"][label] = {"tau": tau, "block": b,
                                    "speedup": tau * t1 / denom}
    del tw, dw
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return res


@torch.inference_mode()
def tree_8b(taus: dict[str, float], budgets: list[int], batches: list[int], topk: int = 4,
            ctx: int = 1024, draft_layers: int = 5, device: str = "cuda", iters: int = 50,
            shape: Shape = QWEN3_8B, attention: str = "sdpa") -> dict:
    """Per batch: {"linear": {verify_ms, draft_ms}, "N<budget>": {...}} of the deepest round
    (B = 16: g = 15) at `ctx` committed tokens, and per budget with a tau in `taus` ("linear",
    "N16", ...) the implied speedup over the linear block: (tau_N / round_N) / (tau / round)."""
    tw, dw = random_pair(shape, draft_layers, device)
    res = {"shape": shape.__dict__, "draft_layers": draft_layers, "context": ctx, "topk": topk,
           "attention": attention}
    for batch in batches:
        dec = FastDecoder(tw, dw, batch, ctx + 64 + max(budgets), device, max_block=16,
                          attention=attention)
        dec.tcache.reset(torch.full((batch,), ctx, device=device))
        d_ = dec.device
        row = {"linear": {"verify_ms": time_step(lambda d=dec: d._verify(16), d_, iters),
                          "draft_ms": time_step(lambda d=dec: d._draft(16), d_, iters)}}
        for n in budgets:
            tdec = TreeDecoder(dec, n, topk, 16)
            tdec._draft(15)  # a real tree in the buffers before the verify is timed
            row[f"N{n}"] = {"verify_ms": time_step(lambda t=tdec: t._verify(15), d_, iters),
                            "draft_ms": time_step(lambda t=tdec: t._draft(15), d_, iters),
                            "nodes": tdec.nodes(15)}
        lin = row["linear"]
        for name, t in row.items():
            t["round_ms"] = t["verify_ms"] + t["draft_ms"]
            if name in taus and "linear" in taus:
                t["tau"] = taus[name]
                t["speedup_vs_linear"] = (taus[name] / t["round_ms"]) / (
                    taus["linear"] / lin["round_ms"])
        res[f"b{batch}"] = row
    del tw, dw
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return res
