"""The `tree` row group of `gpu_speedup.py`: greedy tree rounds (`fast.tree_loop`) in our fast
runtime vs the linear DFlash draft and plain decoding, same prompts, same decoder caches.

Per batch size (1 and 8 by default): plain AR, linear DFlash (B = 16) and tree rounds at each node
budget (B = 16, top-k per depth), each after a warm-up over every shape and one untimed pass:
warm tokens/s, tau, speedup over AR, token identity with AR, nodes per round, accepted-depth
histogram, and isolated step times (graph replay, deepest round: g = 15) of the verify and the
draft (+ tree build) per budget. With `--tree-temperature T` (> 0), also sampled rows: the
chain (top-1, B - 1 nodes: speculative sampling) and each budget, recursive rejection sampling
(our runtime has no sampled AR loop: speed is relative to the chain). CPU smoke (tiny: fp32,
2 prompts, 16 tokens):
    python benchmarks/gpu_speedup.py --device cpu --out /tmp/tree-smoke --rows tree \
        --limit 2 --max-new-tokens 16 --tree-batches 1 2 --tree-budgets 8 16
"""

from __future__ import annotations

import time

import torch

from .common import agreement, checkout_first
from .fast_rows import run_ours, warm_up

checkout_first()

from dflash_plugin.fast import build_decoder  # noqa: E402
from dflash_plugin.fast.graphs import time_step  # noqa: E402
from dflash_plugin.fast.tree_loop import TreeDecoder, tree_generate_fast  # noqa: E402
from dflash_plugin.sampling import SamplingParams  # noqa: E402

BLOCK = 16


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_tree(tdec: TreeDecoder, prompts, batch, max_new) -> dict:
    """All prompts in chunks of `batch` (as `fast_rows.run_ours`), tree rounds (greedy or the
    decoder's sampling params)."""
    toks, reqs, secs, depths, nodes = [], [], [], {}, 0
    for i in range(0, len(prompts), batch):
        sync()
        t0 = time.perf_counter()
        res = tree_generate_fast(tdec, prompts[i:i + batch], max_new_tokens=max_new)
        sync()
        secs.append(time.perf_counter() - t0)
        toks += res.tokens
        reqs += res.metrics.requests
        nodes += res.metrics.tree["nodes_verified"]
        for d, c in res.metrics.tree["accepted_depths"].items():
            depths[d] = depths.get(d, 0) + c
    total, new, rounds = sum(secs), sum(r.new_tokens for r in reqs), sum(r.rounds for r in reqs)
    return {"tokens": toks, "seconds": total, "new_tokens": new,
            "tokens_per_second": new / total,
            "tau": sum(sum(r.round_tokens) for r in reqs) / max(rounds, 1),
            "nodes_per_round": nodes / max(rounds, 1),
            "accepted_depths": dict(sorted(depths.items()))}


@torch.inference_mode()
def step_ms(dec, tdec: TreeDecoder | None, prompt) -> dict:
    """Isolated graph-replay times of the deepest round's steps after a prefill of `prompt`
    (every row): verify (+ walk + compaction) and draft (+ tree build); both only write stale
    slots and buffers, so repeating them is safe."""
    dec.prefill([prompt] * dec.batch, 1)
    g = BLOCK - 1
    if tdec is None:
        return {"verify_ms": time_step(lambda: dec._verify(BLOCK), dec.device),
                "draft_ms": time_step(lambda: dec._draft(BLOCK), dec.device)}
    return {"verify_ms": time_step(lambda: tdec._verify(g), dec.device),
            "draft_ms": time_step(lambda: tdec._draft(g), dec.device), "nodes": tdec.nodes(g)}


def tree_rows(R: dict, model, drafter, prompts, max_new: int, max_len: int, args,
              add_row) -> None:
    """Rows "tree: ..." (R["rows"]) and R["tree"][f"b{batch}"] = per-budget summary."""
    summary = R.setdefault("tree", {})
    budgets = args.tree_budgets
    for batch in args.tree_batches:
        dec = build_decoder(model, drafter, batch=batch, max_len=max_len + max(budgets) + 1,
                            max_block=BLOCK, attention=args.attention,
                            prefill_bucket=args.prefill_bucket, invariant=args.invariant)
        warm = {}
        R["warmup_seconds"][f"tree linear b{batch}"] = warm_up(dec, prompts, batch, warm)
        s = summary[f"b{batch}"] = {}
        runs = {}
        for name, block, prop in (("AR", 1, "ar"), ("linear", BLOCK, "dflash")):
            run_ours(dec, prompts, batch, block, prop, max_new)  # untimed pass
            runs[name] = run_ours(dec, prompts, batch, block, prop, max_new)
        ar = runs["AR"]
        s["linear"] = {**step_ms(dec, None, prompts[0])}
        for budget in budgets:
            tdec = TreeDecoder(dec, budget, args.tree_topk, BLOCK)
            widths = None if dec.prefill_bucket else sorted(
                {max(len(p) for p in prompts[i:i + batch]) for i in range(0, len(prompts),
                                                                          batch)})
            R["warmup_seconds"][f"tree N{budget} b{batch}"] = tdec.warmup(widths)
            run_tree(tdec, prompts, batch, max_new)  # untimed pass
            runs[f"N{budget}"] = run_tree(tdec, prompts, batch, max_new)
            s[f"N{budget}"] = step_ms(dec, tdec, prompts[0])
        for name, r in runs.items():
            extra = {"identity_vs_ar": agreement(r["tokens"], ar["tokens"]),
                     "speedup_vs_ar": r["tokens_per_second"] / ar["tokens_per_second"]}
            if name != "AR":
                extra["speedup_vs_linear"] = (r["tokens_per_second"]
                                              / runs["linear"]["tokens_per_second"])
            s.setdefault(name, {}).update(
                {"tokens_per_second": r["tokens_per_second"], "tau": r["tau"], **extra,
                 **{k: r[k] for k in ("nodes_per_round", "accepted_depths") if k in r}})
            add_row(f"tree: {name}" + (f" k{args.tree_topk}" if name.startswith("N") else ""),
                    batch, 1 if name == "AR" else BLOCK, {**r, **extra}, len(prompts))
        if args.tree_8b:  # the same budgets' round cost at the Qwen3-8B shape, at this tau
            from .projection import tree_8b
            R.setdefault("tree_8b", {})[f"b{batch}"] = tree_8b(
                {k: v["tau"] for k, v in s.items() if "tau" in v and k != "AR"}, budgets,
                [batch], args.tree_topk, attention=args.attention, device=str(dec.device))
        print(f"  tree b{batch}: " + ", ".join(
            f"{k} {v['tokens_per_second']:.1f} tok/s tau {v['tau']:.2f} "
            f"verify {v.get('verify_ms', float('nan')):.3f} ms "
            f"identical {v['identity_vs_ar']['identical']}/{v['identity_vs_ar']['of']}"
            for k, v in s.items() if "tau" in v), flush=True)
        del dec


def sampled_tree_rows(R: dict, model, drafter, prompts, max_new: int, max_len: int, args,
                      add_row) -> None:
    """Rows "tree T=...: chain | N..." and R["tree_sampled"][f"b{batch}"]: the sampled chain
    (top-1 tree of B - 1 nodes) and every budget at `args.tree_temperature`, same decoder."""
    summary = R.setdefault("tree_sampled", {})
    temp, budgets = args.tree_temperature, args.tree_budgets
    params = SamplingParams(temperature=temp, seed=0)
    for batch in args.tree_batches:
        dec = build_decoder(model, drafter, batch=batch, max_len=max_len + max(budgets) + 1,
                            max_block=BLOCK, attention=args.attention,
                            prefill_bucket=args.prefill_bucket, invariant=args.invariant)
        s = summary[f"b{batch}"] = {}
        for name, budget, topk in [("chain", BLOCK - 1, 1)] + [
                (f"N{b}", b, args.tree_topk) for b in budgets]:
            tdec = TreeDecoder(dec, budget, topk, BLOCK, params=params)
            R["warmup_seconds"][f"tree T{temp} {name} b{batch}"] = tdec.warmup()
            run_tree(tdec, prompts, batch, max_new)  # untimed pass
            r = run_tree(tdec, prompts, batch, max_new)
            s[name] = {k: r[k] for k in ("tokens_per_second", "tau", "nodes_per_round",
                                         "accepted_depths")}
            s[name]["speedup_vs_chain"] = r["tokens_per_second"] / s["chain"]["tokens_per_second"]
            add_row(f"tree T={temp}: {name}" + (f" k{topk}" if topk > 1 else ""), batch, BLOCK,
                    {**r, "speedup_vs_chain": s[name]["speedup_vs_chain"]}, len(prompts))
        print(f"  tree T={temp} b{batch}: " + ", ".join(
            f"{k} {v['tokens_per_second']:.1f} tok/s tau {v['tau']:.2f}" for k, v in s.items()),
            flush=True)
        del dec
