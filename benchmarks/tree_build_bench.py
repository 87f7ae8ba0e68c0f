"""Time the token-tree build of a tree round: torch (`reference.tree_build`, about 8 launches per
depth) against the fused Triton kernel (`specdec_kernels.tree_build`, one program per request),
each launched eagerly and replayed as a CUDA graph, at the drafter's shape of DFLASH_TREE
(15 depths, top-4) for node budgets 16 / 32 / 64 and 1 / 4 / 16 / 64 requests. Every row also
checks that both give the same tree. Medians in microseconds.

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
from specdec_kernels.tree_build import tree_build  # noqa: E402

DEV = torch.device(ARGS.device)
DEPTH, TOPK, VOCAB = 15, 4, 151_936


def inputs(bs: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # the top-K of a real vocabulary's log-softmax: one draw per depth, no full vocab needed
    lp = torch.randn(bs, DEPTH, 64, generator=gen).log_softmax(-1) - 3.0
    top_lp, rank = lp.topk(TOPK, dim=-1)
    ids = torch.randint(0, VOCAB, (bs, DEPTH, 64), generator=gen).gather(-1, rank)
    return top_lp.contiguous().to(DEV), ids.contiguous().to(DEV)


def row(bs: int, budget: int) -> dict:
    top_lp, top_ids = inputs(bs, bs * 1000 + budget)
    want = ref.tree_build(top_lp, top_ids, budget)
    got = tree_build(top_lp, top_ids, budget)
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    iters = 3 if ARGS.dry_run else ARGS.iters
    out = {"requests": bs, "budget": budget, "same_tree": same,
           "torch_eager_us": 1e3 * event_ms(lambda: ref.tree_build(top_lp, top_ids, budget),
                                            DEV, iters, 2),
           "triton_eager_us": 1e3 * event_ms(lambda: tree_build(top_lp, top_ids, budget),
                                             DEV, iters, 2)}
    for name, fn in (("torch", ref.tree_build), ("triton", tree_build)):
        ms, _ = graph_ms(lambda f=fn: f(top_lp, top_ids, budget), DEV, iters)
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
