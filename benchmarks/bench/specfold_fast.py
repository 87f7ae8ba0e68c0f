"""The timing core of `specfold_fast_bench.py` (module docstring there: the sections, the row
keys): `Bench` (the run record: time budget, try/except per variant, JSON), `core` (the
capturable verify forward: layers + LM head, no host sync), `time_batch` (dense_fast and
folded_fast per delta on one batch, eager and as one CUDA graph at the capacity plan),
`pages_for` (one request's pages copied for r requests), the
random-weight Qwen3-8B-shaped model (`shape_8b`: a tiny stand-in with --dry-run), the draft
fold ratios of an earlier H200 run (`FALLBACK_RATIOS`) and the main table (`markdown`).
Import it after `specfold_fast_bench.py` has set TRITON_INTERPRET (--dry-run).
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from .common import checkout_first, graph_ms, run_info, wall_ms, write_json
from .specfold import model_8b

checkout_first()

from specfold_plugin import fast_layers as fl  # noqa: E402
from specfold_plugin.fold_fast import folded_exact  # noqa: E402


class Bench:
    """The run record: args `a`, device, start time, R (the JSON), the fixture's draft fold
    ratios per delta (`ratios`, for the 8B shape), DIR."""

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


def shape_8b(a, dev, dtype):
    """The random-weight Qwen3-8B-shaped model (a tiny stand-in with --dry-run)."""
    if a.dry_run:  # tiny stand-in: same code path, interpreter-sized
        cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=96,
                          vocab_size=2048, eos_token_id=None, pad_token_id=None)
        cfg.dllm_block_size, cfg.mask_token_id = 16, 3
        return AutoModelForCausalLM.from_config(cfg).eval().to(dev)
    return model_8b(a.layers_8b, dev).to(dtype)
