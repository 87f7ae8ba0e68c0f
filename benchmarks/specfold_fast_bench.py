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
Timing helpers (formerly a module of their own): `Bench` is the run record (budget, try/except per
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
import traceback
from pathlib import Path
from typing import NamedTuple

from bench.common import (
    DEV_PROMPTS,
    checkout_first,
    fixture,
    graph_ms,
    read_prompts,
    run_info,
    wall_ms,
    write_json,
)

checkout_first()
if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch  # noqa: E402
from bench.specfold import forced_gate, model_8b  # noqa: E402
from specdec_kernels import reference as ref  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config  # noqa: E402

from specfold_plugin import fast_layers as fl  # noqa: E402
from specfold_plugin.fold import folded_forward  # noqa: E402
from specfold_plugin.fold_fast import (  # noqa: E402
    BatchCapacityPlanner,
    CapacityPlanner,
    dense_forward_fast,
    first_overflow,
    folded_exact,
    folded_forward_fast,
)
from specfold_plugin.stats import FoldStats  # noqa: E402
from spiffy_plugin.calibrate import calibrate  # noqa: E402
from spiffy_plugin.decode import DecodeParams  # noqa: E402
from spiffy_plugin.runtime import BlockDiffusionRunner, dllm_spec  # noqa: E402
from spiffy_plugin.spiffy import dense_verify, spiffy_generate  # noqa: E402


class Bench:
    def __init__(self, a, dev):
        self.a, self.dev, self.t0 = a, dev, time.perf_counter()
        self.ratios: dict[float, list] = {}  # delta -> observed (QKV, FFN) draft fold ratios
        self.R = {"run": run_info(dev), "args": vars(a), "checks": [], "rows": [],
                  "errors": {}, "skipped": []}
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.a.budget_s

    def attempt(self, name, fn):
        if self.over():
            self.R["skipped"].append(name)
            return None
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - one variant must not stop the others
            print(f"[error] {name}: {err!r}", flush=True)
            traceback.print_exc()
            self.R["errors"][name] = repr(err)
            return None

    def eager(self, name, fn):
        return self.attempt(name, lambda: round(wall_ms(fn, self.dev, self.a.iters, 1), 4))

    def save(self):
        write_json(self.out / "specfold_fast.json", self.R)


def core(model, batch, prefix, delta, caps, forced=None, shared=False):
    """The capturable forward: layers + LM head, no host sync (delta None = dense)."""
    def fn():
        h, _, counts = fl.run_layers(model, model.model.embed_tokens(batch.ids), batch, prefix,
                                     delta, caps, "own", 0, forced, shared)
        return fl.logits_of(model, h), torch.stack(counts) if counts else None
    return fn


def time_batch(B: Bench, label, model, batch, prefix, forced_of, extra, eager: bool):
    """dense_fast and folded_fast (per delta) on one batch -> rows."""
    a, dev, rows = B.a, B.dev, []
    full, layers = batch.branches * batch.n, len(model.model.layers)
    dense = {"requests": batch.requests, "rows": batch.requests * full}
    with torch.inference_mode():
        if eager or a.sync:
            dense["dense_fast_eager_ms"] = B.eager(f"{label} dense", core(
                model, batch, prefix, None, None))
        dense["dense_fast_graph_ms"] = B.attempt(f"{label} dense graph", lambda: graph_ms(
            core(model, batch, prefix, None, None), dev, a.graph_iters)[0])
        for delta in a.deltas:
            forced = forced_of(delta) if forced_of else None
            row = {**extra, **dense, "delta": delta, "forced_ratio": forced is not None}
            name = f"{label} delta {delta}"
            plan = B.attempt(name + " plan", lambda d=delta, f=forced: folded_exact(
                model, batch, prefix, d, [(full, full)] * layers, forced=f))
            if plan is None:
                continue
            caps = [tuple(min(full, -(-int(c) // 16) * 16) for c in lc)
                    for lc in plan[1].amax(-1)]
            qkv, ffn = (plan[1][:, g].sum().item() / (layers * batch.requests * full)
                        for g in (0, 1))
            row.update(fold_qkv=round(1 - qkv, 4), fold_ffn=round(1 - ffn, 4),
                       cap_share=round(sum(sum(c) for c in caps) / (2 * layers * full), 4))
            if eager:
                row["folded_fast_eager_ms"] = B.eager(name, lambda d=delta, c=caps, f=forced:
                                                      folded_exact(model, batch, prefix, d, c,
                                                                   forced=f))
            if a.sync:  # each gate sized from its true count: eager only (host reads)
                row["folded_sync_eager_ms"] = B.eager(name + " sync", lambda d=delta, f=forced:
                                                      folded_exact(model, batch, prefix, d,
                                                                   [(None, None)] * layers,
                                                                   forced=f))
            got = B.attempt(name + " graph", lambda d=delta, c=caps, f=forced: graph_ms(
                core(model, batch, prefix, d, c, f), dev, a.graph_iters))
            if got and got[0] is not None:
                row.update(folded_fast_graph_ms=got[0], graph_plan_fits=bool(
                    (got[1][1].cpu() <= torch.tensor(caps)[:, :, None]).all()))
                if row.get("dense_fast_graph_ms"):
                    row["speedup_graph"] = round(row["dense_fast_graph_ms"] / got[0], 3)
            if a.sync:  # the planner's margin on top of the true counts, as one graph
                padded = [tuple(min(full, -(-(c + full // 8) // 16) * 16) for c in lc)
                          for lc in caps]
                row["folded_margin_graph_ms"] = B.attempt(
                    name + " margin graph", lambda d=delta, c=padded, f=forced: graph_ms(
                        core(model, batch, prefix, d, c, f), dev, a.graph_iters)[0])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def pages_for(prefix: fl.Prefix | None, r: int, dev) -> fl.Prefix | None:
    """r requests with copies of one request's pages (contiguous pool, own block tables)."""
    if r == 1 or prefix is None:
        return prefix
    n = prefix.keys[0].shape[0]
    return fl.Prefix([torch.cat([k] * r) for k in prefix.keys],
                     [torch.cat([v] * r) for v in prefix.values],
                     torch.arange(r * n, dtype=torch.int32, device=dev).view(r, n),
                     prefix.lens.expand(r).contiguous())


COLS = ["shape", "drafts", "requests", "rows", "delta", "fold_qkv", "fold_ffn", "cap_share",
        "dense_hf_ms", "folded_torch_ms", "dense_fast_eager_ms", "folded_fast_eager_ms",
        "folded_sync_eager_ms", "dense_fast_graph_ms", "folded_fast_graph_ms",
        "folded_margin_graph_ms", "speedup_graph"]


def markdown(R) -> str:
    rows = [r for r in R["rows"] if "delta" in r]
    lines = ["| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    lines += ["| " + " | ".join("-" if r.get(c) is None else str(r[c]) for c in COLS) + " |"
              for r in rows]
    lines += ["", "Crossover (CUDA graphs; smallest rows where folded_fast beats dense_fast):"]
    for shape, drafts, delta in sorted({(r["shape"], r["drafts"], r["delta"]) for r in rows}):
        pts = sorted((r["rows"], r["speedup_graph"]) for r in rows if r.get("speedup_graph")
                     and (r["shape"], r["drafts"], r["delta"]) == (shape, drafts, delta))
        win = [x for x, s in pts if s > 1]
        lines.append(f"- {shape} D*={drafts} delta {delta}: {win[0] if win else 'none'} "
                     f"(rows: speedup {', '.join(f'{x}: {s}' for x, s in pts)})")
    return "\n".join(lines) + "\n"


FALLBACK_RATIOS = {0.05: (0.529, 0.434), 0.1: (0.672, 0.606), 0.2: (0.80, 0.764),
                   0.3: (0.867, 0.849)}  # draft rows, H200 e2e run (results/specfold-gpu)


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


def tree_blocks(root, kept):
    """A binary-ish draft tree: each draft unmasks one more position of its parent."""
    parents = [-1] + [max(0, (i - 1) // 2) for i in range(1, kept + 1)]
    blocks = [root]
    for i, p in enumerate(parents[1:], 1):
        nxt = blocks[p].clone()
        nxt[6 + (i - 1) % 10] = 1000 + i
        blocks.append(nxt)
    return torch.stack(blocks), parents


def shape_8b(a, dev, dtype):
    """The random-weight Qwen3-8B-shaped model (a tiny stand-in with --dry-run)."""
    if a.dry_run:  # tiny stand-in: same code path, interpreter-sized
        cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=96,
                          vocab_size=2048, eos_token_id=None, pad_token_id=None)
        cfg.dllm_block_size, cfg.mask_token_id = 16, 3
        return AutoModelForCausalLM.from_config(cfg).eval().to(dev)
    return model_8b(a.layers_8b, dev).to(dtype)


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


class State(NamedTuple):
    """One request's verify input for the batch section."""
    blocks: torch.Tensor  # [k, n] ids
    parents: list[int]  # [k]
    context: int  # committed tokens
    keys: list[torch.Tensor] | None  # [layers] [context, kv_heads, hd]; None = random pages
    values: list[torch.Tensor] | None
    forced: list[tuple] | None  # [layers] (attention, FFN) folds [k, n] bool; None = the gate
    counts: torch.Tensor  # [layers, 2] recomputed rows (host)


def draft_shares(st: State) -> torch.Tensor:
    """[layers, 2] share of the draft rows folded (the root's rows always recompute)."""
    k, n = st.blocks.shape
    return 1 - (st.counts.double() - n) / ((k - 1) * n)


def decoded_states(B: Bench, model, tok, kept, delta, want) -> list[State]:
    """Real verify inputs with D* = kept from Spiffy decoding of the dev prompts (every other
    matching verify call; K/V copied), each with its true counts at delta."""
    a, layers, states = B.a, len(model.model.layers), []
    prompts = read_prompts(a.prompts)
    calib = [tok(p).input_ids for p in prompts[1: 1 + a.calib_prompts]]
    graph = calibrate(model, calib, a.graph_budget, DecodeParams(), a.calib_tokens)
    calls = [0]

    def probe(runner, blocks, parents):
        calls[0] += 1
        if len(parents) == kept + 1 and len(states) < want and calls[0] % 2 and runner.cached:
            c, k = runner.cached, len(parents)
            batch = fl.prepare(model, blocks[None], parents, [c])
            counts = folded_exact(model, batch, fl.runner_prefix(runner), delta,
                                  [(k * blocks.shape[1],) * 2] * layers)[1][:, :, 0]
            kv = [tuple(t[0, :, :c].transpose(0, 1).contiguous() for t in (e.keys, e.values))
                  for e in runner.cache.layers]
            states.append(State(blocks.clone(), list(parents), c, [x for x, _ in kv],
                                [y for _, y in kv], None, counts))
        return dense_verify(runner, blocks, parents)
    for p in [prompts[0], *prompts[1 + a.calib_prompts:]][: a.batch_prompts]:
        if len(states) >= want:
            break
        spiffy_generate(model, tok(p).input_ids, graph, DecodeParams(), a.max_new_tokens,
                        keep=kept, verify=probe)
    return states


def forced_states(model, kept, delta, profiles, count, context, seed=0) -> list[State]:
    """Synthetic verify inputs: a draft tree, ragged contexts, fold sets forced per request at a
    fixture state's per-layer draft fold shares (`profiles` [*] [fixture layers, 2], cycled;
    layer i of this model takes fixture layer i * L_fix // L)."""
    spec = dllm_spec(model.config)
    n, layers = spec.block_size, len(model.model.layers)
    g = torch.Generator().manual_seed(seed)
    root = torch.randint(3, spec.vocab_size - 2, (n,), generator=g)
    root[6:] = spec.mask_token_id
    blocks, parents = tree_blocks(root, kept)
    par = torch.tensor(parents)
    out = []
    for j in range(count):
        prof = profiles[j % len(profiles)]
        forced = []
        for i in range(layers):
            share = prof[i * len(prof) // layers]
            forced.append(tuple((torch.rand(kept + 1, n, generator=g) < float(x))
                                & (par >= 0)[:, None] for x in share))
        counts = torch.tensor([[int((ref.resolve_sources(f, par).view(-1)
                                     == torch.arange(f.numel())).sum()) for f in lf]
                               for lf in forced])
        out.append(State(blocks, parents, context - n * (j % 4), None, None, forced, counts))
    return out


def assemble(states: list[State], model, dev, dtype):
    """One batch of distinct requests: ids / trees / rope (`fl.prepare`), a paged pool (page =
    one block) holding each request's prefix, forced folds [layers] (attn, FFN) [R * k, n]."""
    spec, cfg = dllm_spec(model.config), model.config
    ps, layers = spec.block_size, len(model.model.layers)
    batch = fl.prepare(model, torch.stack([s.blocks for s in states]),
                       [s.parents for s in states], [s.context for s in states])
    pages = [-(-s.context // ps) for s in states]
    table = torch.zeros(len(states), max(max(pages), 1), dtype=torch.int32)
    start = 0
    for j, p in enumerate(pages):
        table[j, :p] = torch.arange(start, start + p)
        start += p
    size = (max(start, 1) * ps, cfg.num_key_value_heads, cfg.head_dim)
    pools = ([], [])
    for i in range(layers):
        for side, pool in enumerate(pools):
            if states[0].keys is None:
                pool.append(torch.randn(size, device=dev, dtype=dtype).view(-1, ps, *size[1:]))
                continue
            t = torch.zeros(size, device=dev, dtype=dtype)
            for j, s in enumerate(states):
                o = int(table[j, 0]) * ps
                t[o: o + s.context] = (s.keys if side == 0 else s.values)[i]
            pool.append(t.view(-1, ps, *size[1:]))
    lens = torch.tensor([s.context for s in states], dtype=torch.int32, device=dev)
    prefix = fl.Prefix(*pools, table.to(dev), lens)
    forced = None
    if states[0].forced is not None:
        forced = [tuple(torch.cat([s.forced[i][g] for s in states]).to(dev) for g in (0, 1))
                  for i in range(layers)]
    return batch, prefix, forced


def round16(counts: torch.Tensor, full: int):  # [layers, 2] -> caps
    return [tuple(min(full, max(16, -(-int(c) // 16) * 16)) for c in lc) for lc in counts]


def batch_rows(B: Bench, shape, model, states, hold, delta, extra):
    """The section's rows of one shape: per --requests-batch R, the first R states timed; the
    planners fed with --history forwards of R states each from `hold` (cycled)."""
    for r in B.a.requests_batch:
        if r > len(states) or not hold:
            B.R["skipped"].append(f"batch {shape} r={r} (states: {len(states)})")
            continue
        row = batch_row(B, shape, model, states[:r], hold, delta)
        B.R["batch_rows"].append({**extra, **row})
        print(json.dumps(B.R["batch_rows"][-1]), flush=True)
        B.save()


def batch_row(B: Bench, shape, model, states, hold, delta) -> dict:
    """One timed batch of len(states) requests (module docstring, section batch)."""
    a, dev, r = B.a, B.dev, len(states)
    dtype = model.model.embed_tokens.weight.dtype
    layers = len(model.model.layers)
    k, n = states[0].blocks.shape
    label = f"batch {shape} r={r}"
    batch, prefix, forced = assemble(states, model, dev, dtype)
    counts = torch.stack([s.counts for s in states], -1)  # [layers, 2, r]
    per_p, shared_p = CapacityPlanner(), BatchCapacityPlanner()
    for h in range(a.history):
        hc = torch.stack([hold[(h * r + j) % len(hold)].counts for j in range(r)], -1)
        per_p.update(k, n, hc)
        shared_p.update(k, n, hc)
    full = k * n
    plans = {"per_request": (per_p.plan(k, n, layers), False),
             "per_request_oracle": (round16(counts.amax(-1), full), False),
             "shared": (shared_p.plan(k, n, layers, r), True),
             "shared_oracle": (round16(counts.sum(-1), r * full), True)}
    row = {"shape": shape, "requests": r, "rows": r * full, "delta": delta,
           "contexts": [s.context for s in states],
           "fold_qkv": round(1 - counts[:, 0].sum().item() / (layers * r * full), 4),
           "fold_ffn": round(1 - counts[:, 1].sum().item() / (layers * r * full), 4)}
    with torch.inference_mode():
        row["dense_graph_ms"] = B.attempt(label + " dense", lambda: graph_ms(
            core(model, batch, prefix, None, None), dev, a.graph_iters)[0])
        for name, (caps, sh) in plans.items():
            first = first_overflow(counts, caps, "own", sh)
            row[f"{name}_cap_share"] = round(sum(map(sum, caps)) / (
                2 * layers * (r * full if sh else full)), 4)
            row[f"{name}_rerun_layers"] = 0 if first is None else layers - first
            ms = B.attempt(f"{label} {name}", lambda c=caps, s=sh: graph_ms(
                core(model, batch, prefix, delta, c, forced, s), dev, a.graph_iters)[0])
            row[f"{name}_graph_ms"] = ms
            if ms and row["dense_graph_ms"]:
                row[f"{name}_speedup"] = round(row["dense_graph_ms"] / ms, 3)
        row["batch_check"] = B.attempt(label + " check", lambda: batch_check(
            model, batch, prefix, delta, forced, counts))
    return row


def batch_check(model, batch, prefix, delta, forced, counts):
    """Shared vs per-request logits (eager, full capacity): max |diff| and equal counts."""
    layers, full = len(model.model.layers), batch.branches * batch.n
    per = folded_exact(model, batch, prefix, delta, [(full, full)] * layers, forced=forced)
    sh = folded_exact(model, batch, prefix, delta, [(batch.requests * full,) * 2] * layers,
                      forced=forced, shared=True)
    ok = torch.isfinite(per[0]) & torch.isfinite(sh[0])
    return {"max_diff": float((per[0] - sh[0]).abs()[ok].max()),
            "counts_equal": bool(torch.equal(per[1], sh[1]) and torch.equal(per[1], counts))}


def batch_section(B: Bench, model, tok, dtype):
    """Fixture states first (their fold shares also drive the 8B shape), then the 8B shape."""
    a = B.a
    delta, kept, top = a.batch_delta, a.batch_drafts, max(a.requests_batch)
    B.R.setdefault("batch_rows", [])
    states = B.attempt("batch states", lambda: decoded_states(B, model, tok, kept, delta,
                                                              top + a.hold_states)) or []
    B.R["batch_states"] = len(states)
    profiles = [draft_shares(s) for s in states]
    if not profiles:
        prof = torch.tensor(FALLBACK_RATIOS.get(delta, (0.5, 0.5)), dtype=torch.float64)
        profiles = [prof[None]]
    if "fixture" in a.batch_shapes and states:
        timed, hold = states[:top], states[top:]
        if not hold:  # too few states: plan from the timed ones (says so in the JSON)
            hold = timed
            B.R["batch_fixture_hold_is_timed"] = True
        B.attempt("batch fixture", lambda: batch_rows(B, "fixture", model, timed, hold, delta,
                                                      {"drafts": kept}))
    if "8b" in a.batch_shapes:
        del model
        if B.dev.type == "cuda":
            torch.cuda.empty_cache()
        big = shape_8b(a, B.dev, dtype)
        shape = "tiny" if a.dry_run else f"qwen3-8b-{len(big.model.layers)}L"
        made = forced_states(big, kept, delta, profiles, top + a.hold_states, a.context_8b)
        B.R["batch_8b_shares"] = [round(1 - float(s.counts[:, g].sum()) / (
            s.counts.shape[0] * s.blocks.numel()), 4) for s in made[:4] for g in (0, 1)]
        B.attempt("batch 8b", lambda: batch_rows(B, shape, big, made[:top], made[top:], delta,
                                                 {"drafts": kept}))


BATCH_COLS = ["shape", "requests", "rows", "fold_qkv", "fold_ffn", "dense_graph_ms",
              "per_request_graph_ms", "per_request_speedup", "per_request_cap_share",
              "per_request_rerun_layers", "shared_graph_ms", "shared_speedup", "shared_cap_share",
              "shared_rerun_layers", "per_request_oracle_speedup", "shared_oracle_speedup"]


def batch_markdown(R) -> str:
    rows = R.get("batch_rows", [])
    if not rows:
        return ""
    lines = ["", "Batch-wide compaction (CUDA graphs; ms; speedup vs dense):",
             "| " + " | ".join(BATCH_COLS) + " |", "|" + "---|" * len(BATCH_COLS)]
    lines += ["| " + " | ".join("-" if r.get(c) is None else str(r[c]) for c in BATCH_COLS)
              + " |" for r in rows]
    return "\n".join(lines) + "\n"


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
