"""Time the token tree of a tree round, its build and its verify layout: torch
(`reference.tree_build` + `reference.tree_tensors`, about 180 launches) against the Triton
kernels (`specdec_kernels.tree_build`: `tree_build` + `tree_tensors`, one program per request
each), each launched eagerly and replayed as a CUDA graph, at the drafter's shape of
DFLASH_TREE (15 depths, top-4) for node budgets 16 / 32 / 64 and 1 / 4 / 16 / 64 requests.
Every row also checks that both give the same tensors. Medians in microseconds.

    python benchmarks/tree_build_bench.py --out benchmarks/results/tree-build            # GPU
    python benchmarks/tree_build_bench.py --device cpu --dry-run --out OUT   # logic check
"""

from __future__ import annotations

import os

from bench.common import checkout_first, event_ms, graph_ms, kernel_args, run_info, write_json

ARGS = kernel_args(__doc__)
checkout_first()

import torch  # noqa: E402
from specdec_kernels import reference as ref  # noqa: E402
from specdec_kernels import tree_build as kern  # noqa: E402

DEV = torch.device(ARGS.device)
DEPTH, TOPK, VOCAB = 15, 4, 151_936


def inputs(bs: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # the top-K of a real vocabulary's log-softmax: one draw per depth, no full vocab needed
    lp = torch.randn(bs, DEPTH, 64, generator=gen).log_softmax(-1) - 3.0
    top_lp, rank = lp.topk(TOPK, dim=-1)
    ids = torch.randint(0, VOCAB, (bs, DEPTH, 64), generator=gen).gather(-1, rank)
    return top_lp.contiguous().to(DEV), ids.contiguous().to(DEV)


def tree(ops, top_lp, top_ids, budget, root, lens):
    """The build, then the verify layout, with `ops` (the reference module or the kernels')."""
    return ops.tree_tensors(*ops.tree_build(top_lp, top_ids, budget), root, lens, DEPTH)


def row(bs: int, budget: int) -> dict:
    top_lp, top_ids = inputs(bs, bs * 1000 + budget)
    root = torch.zeros(bs, dtype=torch.long, device=DEV)
    lens = torch.full((bs,), 1024, dtype=torch.long, device=DEV)
    args = (top_lp, top_ids, budget, root, lens)
    same = all(torch.equal(a, b) for a, b in zip(tree(kern, *args), tree(ref, *args)))
    iters = 3 if ARGS.dry_run else ARGS.iters
    out = {"requests": bs, "budget": budget, "same_tree": same}
    for name, ops in (("torch", ref), ("triton", kern)):
        out[f"{name}_eager_us"] = 1e3 * event_ms(lambda o=ops: tree(o, *args), DEV, iters, 2)
        ms, _ = graph_ms(lambda o=ops: tree(o, *args), DEV, iters)
        out[f"{name}_graph_us"] = None if ms is None else 1e3 * ms
    print(out, flush=True)
    return out


def main() -> None:
    grid = [(1, 32), (2, 16)] if ARGS.dry_run else [
        (bs, n) for n in (16, 32, 64) for bs in (1, 4, 16, 64)]
    rows = [row(bs, n) for bs, n in grid]
    assert all(r["same_tree"] for r in rows), "the kernel built another tree"
    write_json(os.path.join(ARGS.out, "tree_build.json"),
               {"run": run_info(DEV), "depth": DEPTH, "topk": TOPK, "rows": rows})


if __name__ == "__main__":
    main()
