"""Section `batch` of `specfold_fast_bench.py` (module docstring there; issue 21 part 3): per
shape and --requests-batch R, CUDA graphs, Spiffy's dense verify vs per-request folded
(`CapacityPlanner`) vs batch-wide folded (`BatchCapacityPlanner`, shared=True), both planned from
--history earlier forwards of other states, plus each with the oracle plan. Verify inputs
(`State`): real ones from Spiffy decoding of the fixture (`decoded_states`, K/V copied) and
synthetic ones at the Qwen3-8B shape with fold sets forced at the fixture's per-layer shares
(`forced_states`); `assemble` packs distinct requests into one batch with a paged pool;
`batch_markdown` is the section's table.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import torch

from .common import checkout_first, graph_ms, read_prompts
from .specfold import tree_blocks
from .specfold_fast import FALLBACK_RATIOS, Bench, core, shape_8b

checkout_first()

from specdec_kernels import reference as ref  # noqa: E402

from specfold_plugin import fast_layers as fl  # noqa: E402
from specfold_plugin.fold_fast import (  # noqa: E402
    BatchCapacityPlanner,
    CapacityPlanner,
    first_overflow,
    folded_exact,
)
from spiffy_plugin.calibrate import calibrate  # noqa: E402
from spiffy_plugin.decode import DecodeParams  # noqa: E402
from spiffy_plugin.runtime import dllm_spec  # noqa: E402
from spiffy_plugin.spiffy import dense_verify, spiffy_generate  # noqa: E402


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
