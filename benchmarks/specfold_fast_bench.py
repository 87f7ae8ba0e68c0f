"""Verify-forward latency: dense vs SpecFold folded, torch reference vs the Triton kernel backend.

    python benchmarks/specfold_fast_bench.py --out OUT                              # H200
    python benchmarks/specfold_fast_bench.py --device cpu --dry-run --out OUT      # logic check
Per (shape, D* kept drafts, requests, delta): `dense_hf` = Spiffy's dense verify (HF forward) and
`folded_torch` = `fold.folded_forward` (1 request, eager); `dense_fast` / `folded_fast` = the
`fast_layers` forward on the kernels, eager (folded: `fold_fast.folded_exact`, one host sync) and
as one CUDA graph (folded: captured at the capacity plan = this batch's true counts rounded up to
16). Shapes: the fixture at real decoding states (prompt 0 of --prompts, graph calibrated on the
next ones; more requests = the state replicated, pages copied) and a random-weight Qwen3-8B
shape (--context-8b tokens per request) with the fixture's draft fold ratios of this run forced
through the gate. `checks` first: kernel vs reference logits and fold counts (fp32 and bf16).
Each variant in try/except; --budget-s skips what is left; DIR/specfold_fast.json + .md.
Timing helpers (`bench/specfold_fast.py`): `Bench` is the run record (budget, try/except per
variant, JSON); *capacity plan* of a timed folded forward = its true per-layer counts rounded up
to 16 rows. With --sync also: `folded_sync_eager_ms` (capacities None: each gate sized from its
true count at run time, eager) and `folded_margin_graph_ms` (the graph with the planner's margin,
1/8 of the rows, added to the true counts: what a well-predicted `CapacityPlanner` plan costs).
Section `batch` (issue 21 part 3; not in the default --sections): per shape (the fixture at real
decoding states, distinct per request with ragged contexts; the Qwen3-8B shape with random
weights and per-request fold sets forced at the fixture's per-state, per-layer ratios) and
--requests-batch R, CUDA graphs: Spiffy's verify (dense, same kernels) vs per-request folded
(`CapacityPlanner`) vs batch-wide folded (`BatchCapacityPlanner`, shared=True), both planned from
--history earlier forwards of OTHER states (no oracle), plus each with the oracle plan (true
counts rounded up to 16) for reference; `*_rerun_layers` = layers a decoder would re-run where
the plan was too small (then the graph's output is wrong, its time a lower bound).
`batch_check`: max |logit diff| of shared vs per-request (eager, full capacity).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench.common import DEV_PROMPTS, checkout_first, fixture, read_prompts

checkout_first()
if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch  # noqa: E402
from bench.specfold import forced_gate, tree_blocks  # noqa: E402
from bench.specfold_batch import batch_markdown, batch_section  # noqa: E402
from bench.specfold_fast import (  # noqa: E402
    FALLBACK_RATIOS,
    Bench,
    markdown,
    pages_for,
    shape_8b,
    time_batch,
)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from specfold_plugin import fast_layers as fl  # noqa: E402
from specfold_plugin.fold import folded_forward  # noqa: E402
from specfold_plugin.fold_fast import dense_forward_fast, folded_forward_fast  # noqa: E402
from specfold_plugin.stats import FoldStats  # noqa: E402
from spiffy_plugin.calibrate import calibrate  # noqa: E402
from spiffy_plugin.decode import DecodeParams  # noqa: E402
from spiffy_plugin.runtime import BlockDiffusionRunner, dllm_spec  # noqa: E402
from spiffy_plugin.spiffy import dense_verify, spiffy_generate  # noqa: E402


def fixture_section(B: Bench, model, tok):
    a = B.a
    prompts = read_prompts(a.prompts)
    calib = [tok(p).input_ids for p in prompts[1: 1 + a.calib_prompts]]
    graph = calibrate(model, calib, a.graph_budget, DecodeParams(), a.calib_tokens)
    ids = tok(prompts[0]).input_ids
    for kept in a.branches:
        seen = [0]

        def probe(runner, blocks, parents, kept=kept, seen=seen):
            if len(parents) == kept + 1 and seen[0] < a.samples * 3:
                seen[0] += 1
                if seen[0] % 3 == 0 and not B.over():
                    fixture_state(B, model, runner, blocks, parents, kept)
            return dense_verify(runner, blocks, parents)
        B.attempt(f"fixture D*={kept}", lambda p=probe, k=kept: spiffy_generate(
            model, ids, graph, DecodeParams(), a.max_new_tokens, keep=k, verify=p))
        B.save()


def fixture_state(B: Bench, model, runner, blocks, parents, kept):
    a, nfe, layers = B.a, runner.nfe, len(model.model.layers)
    extra = {"shape": "fixture", "drafts": kept, "context": runner.cached}
    hf = B.eager("fixture dense_hf", lambda: dense_verify(runner, blocks, parents))
    ref = {}
    for delta in a.deltas:
        ref[delta] = B.eager(f"fixture torch {delta}", lambda d=delta: folded_forward(
            runner, blocks, parents, d))
        st = FoldStats(layers)
        folded_forward(runner, blocks, parents, delta, st)
        B.ratios.setdefault(delta, []).append((st.fold_ratio("qkv", True),
                                               st.fold_ratio("ffn", True)))
    for r in a.requests:
        batch = fl.prepare(model, blocks[None].expand(r, -1, -1), parents, [runner.cached] * r)
        prefix = pages_for(fl.runner_prefix(runner), r, B.dev)
        for row in time_batch(B, f"fixture D*={kept} r={r}", model, batch, prefix, None, extra,
                              eager=r == 1):
            if r == 1:
                row.update(dense_hf_ms=hf, folded_torch_ms=ref.get(row["delta"]))
            B.R["rows"].append(row)
    runner.nfe = nfe


def section_8b(B: Bench, dtype):
    a, dev = B.a, B.dev
    model = shape_8b(a, dev, dtype)
    spec = dllm_spec(model.config)
    n, layers, vocab = spec.block_size, len(model.model.layers), spec.vocab_size
    kvh, hd = model.config.num_key_value_heads, model.config.head_dim
    ratios = {d: tuple(statistics.mean(x[i] for x in B.ratios[d]) for i in (0, 1))
              if B.ratios.get(d) else FALLBACK_RATIOS.get(d, (0.5, 0.5)) for d in a.deltas}
    B.R["ratios_8b"] = {str(d): r for d, r in ratios.items()}
    gen = torch.Generator().manual_seed(0)
    ctx, shape = a.context_8b, "tiny" if a.dry_run else f"qwen3-8b-{layers}L"
    root = torch.randint(3, vocab - 2, (n,), generator=gen)
    root[6:] = spec.mask_token_id
    with torch.inference_mode():
        runner = BlockDiffusionRunner(model, spec)
        runner.forward(torch.randint(3, vocab - 2, (ctx,), generator=gen), root[None])
    for kept in a.branches:
        blocks, parents = tree_blocks(root, kept)
        extra = {"shape": shape, "drafts": kept, "context": ctx}
        hf = B.eager(f"8b dense_hf D*={kept}", lambda b=blocks, p=parents: dense_verify(
            runner, b, p))
        torch_ms = {d: B.eager(f"8b torch D*={kept} {d}", lambda d=d, b=blocks, p=parents:
                               folded_forward(runner, b, p, d, gate_fn=forced_gate(ratios[d],
                                                                                    dev)))
                    for d in a.deltas}
        for r in a.requests_8b:
            batch = fl.prepare(model, blocks[None].expand(r, -1, -1), parents, [ctx] * r)
            prefix = fl.runner_prefix(runner)
            if r > 1:  # fresh random pages per request
                size = (r * (ctx // n), n, kvh, hd)
                prefix = fl.Prefix(*([torch.randn(size, device=dev, dtype=dtype) for _ in
                                      range(layers)] for _ in range(2)),
                                   torch.arange(r * (ctx // n), dtype=torch.int32,
                                                device=dev).view(r, -1),
                                   torch.full((r,), ctx, dtype=torch.int32, device=dev))
            roots = torch.arange(r * (kept + 1), device=dev) % (kept + 1) == 0

            def forced_of(delta, roots=roots):
                g = torch.Generator(device=dev).manual_seed(0)
                return [tuple((torch.rand(len(roots), n, generator=g, device=dev) < x)
                              & ~roots[:, None] for x in ratios[delta]) for _ in range(layers)]
            for row in time_batch(B, f"8b D*={kept} r={r}", model, batch, prefix, forced_of,
                                  extra, eager=r == 1):
                if r == 1:
                    row.update(dense_hf_ms=hf, folded_torch_ms=torch_ms.get(row["delta"]))
                B.R["rows"].append(row)
            B.save()


def checks(B: Bench, path, model_bf):
    """Kernel path vs reference on the fixture (fp32 and the timing dtype): max |logit diff|
    over finite entries, per-layer fold counts equal."""
    def diff(x, y):
        ok = torch.isfinite(x) & torch.isfinite(y)
        return float((x - y).abs()[ok].max())
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(B.dev).eval()
    for model in (fp32, model_bf):
        spec, layers = dllm_spec(model.config), len(model.model.layers)
        gen = torch.Generator().manual_seed(0)
        root = torch.randint(3, spec.vocab_size - 1, (spec.block_size,), generator=gen)
        root[6:] = spec.mask_token_id
        blocks, parents = tree_blocks(root, 8)
        with torch.inference_mode():
            runner = BlockDiffusionRunner(model, spec)
            runner.forward(torch.randint(3, spec.vocab_size - 1, (64,), generator=gen), root[None])
            dense = dense_verify(runner, blocks, parents)
            row = {"dtype": str(model.dtype),
                   "dense_fast_vs_dense": diff(dense_forward_fast(runner, blocks), dense)}
            for delta in (0.0, 0.1):
                s_r, s_f = FoldStats(layers), FoldStats(layers)
                ref = folded_forward(runner, blocks, parents, delta, s_r)
                got = folded_forward_fast(runner, blocks, parents, delta, s_f)
                row[f"delta_{delta}"] = {
                    "fast_vs_torch": diff(got, ref), "fast_vs_dense": diff(got, dense),
                    "counts_equal": (s_r.qkv_rows, s_r.ffn_rows) == (s_f.qkv_rows, s_f.ffn_rows),
                    "fold_qkv": round(s_r.fold_ratio("qkv"), 4)}
        B.R["checks"].append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(fixture("code-dllm")), help="model folder")
    p.add_argument("--prompts", default=str(DEV_PROMPTS))
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sections", nargs="+", default=["checks", "fixture", "8b"])
    p.add_argument("--deltas", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3])
    p.add_argument("--branches", type=int, nargs="+", default=[2, 4, 8], help="D* values")
    p.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16], help="fixture")
    p.add_argument("--requests-8b", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--samples", type=int, default=2, help="decoding states per D* (fixture)")
    p.add_argument("--iters", type=int, default=10, help="eager timing iterations")
    p.add_argument("--graph-iters", type=int, default=30)
    p.add_argument("--calib-prompts", type=int, default=4)
    p.add_argument("--calib-tokens", type=int, default=64)
    p.add_argument("--graph-budget", type=int, default=10, help="D: draft graph nodes")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--layers-8b", type=int, default=36)
    p.add_argument("--context-8b", type=int, default=1024)
    p.add_argument("--budget-s", type=float, default=200.0, help="skip what is left after this")
    p.add_argument("--requests-batch", type=int, nargs="+", default=[1, 4, 8, 16],
                   help="section batch: requests per forward")
    p.add_argument("--batch-shapes", nargs="+", default=["fixture", "8b"])
    p.add_argument("--batch-delta", type=float, default=0.1)
    p.add_argument("--batch-drafts", type=int, default=8, help="section batch: D*")
    p.add_argument("--hold-states", type=int, default=16, help="section batch: states only the "
                   "planners see (beyond the timed max(--requests-batch))")
    p.add_argument("--history", type=int, default=8, help="section batch: forwards the "
                   "planners see before the timed one")
    p.add_argument("--batch-prompts", type=int, default=6, help="section batch: most prompts "
                   "decoded to collect fixture states")
    p.add_argument("--sync", action="store_true", help="also time sync capacities (eager) and "
                   "the planner's margin (graph); dense eager at every request count")
    p.add_argument("--dry-run", action="store_true", help="tiny settings (CPU: interpreter)")
    a = p.parse_args()
    if a.dry_run:
        a.deltas, a.branches, a.requests, a.requests_8b = [0.1], [2], [1, 2], [1, 2]
        a.samples, a.iters, a.graph_iters, a.calib_prompts, a.calib_tokens = 1, 1, 1, 1, 16
        a.max_new_tokens, a.context_8b, a.graph_budget = 32, 32, 3
        a.requests_batch, a.hold_states, a.history, a.batch_drafts = [1, 2], 2, 2, 2
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    B = Bench(a, dev)

    def fixture_part():
        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(dev).eval()
        if "checks" in a.sections:
            B.attempt("checks", lambda: checks(B, a.model, model))
            B.save()
        if "fixture" in a.sections:
            B.attempt("fixture", lambda: fixture_section(B, model, tok))
        if "batch" in a.sections:
            B.attempt("batch", lambda: batch_section(B, model, tok, dtype))
    fixture_part()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    if "8b" in a.sections:
        B.attempt("8b", lambda: section_8b(B, dtype))
    B.R["seconds"] = round(time.perf_counter() - B.t0, 1)
    B.save()
    (B.out / "specfold_fast.md").write_text(markdown(B.R) + batch_markdown(B.R))
    print(markdown(B.R) + batch_markdown(B.R))
    print(f"wrote {B.out / 'specfold_fast.json'} in {B.R['seconds']} s; errors: "
          f"{list(B.R['errors'])}; skipped: {len(B.R['skipped'])} variants")


if __name__ == "__main__":
    main()
