"""SpecFold vs Spiffy vs vanilla: fold ratio, agreement, NFE (any device); verify latency and
tokens/s (CUDA only; CPU seconds are recorded but are not a speed result).

    PYTHONPATH=. python benchmarks/specfold_bench.py --model examples/fixtures/code-dllm \
        --prompts examples/fixtures/dev-prompts.jsonl --calib 32:40 --eval 0:8 \
        --max-new-tokens 128 --budget 10 --out benchmarks/results/specfold-cpu
Sections (`--sections`): `e2e` = vanilla / Spiffy / SpecFold per delta on the eval prompts
(fold ratios, token agreement with Spiffy, NFE, projected FLOP saving, seconds; with `--backends
... triton` also Spiffy with its dense verify on the same kernels, after an untimed warm-up);
`steps` = per verify forward, does each draft's next greedy step agree between folded and dense
logits; `latency`
(CUDA) = one verify forward, dense (Spiffy) vs folded per delta, at 2/4/8 kept drafts, timed on
real decoding states of the fixture; `8b` (CUDA) = the same on a random-weight Qwen3-8B-shaped
model (bf16, `--layers-8b` layers, `--context-8b` committed tokens) with the fixture's observed
per-delta fold ratios forced through the gate (random weights give meaningless residuals).
Every variant runs in try/except; results are written to `--out`/specfold.json after each part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from itertools import product
from pathlib import Path

import torch
from bench.common import DEV_PROMPTS, fixture, read_prompts, run_info, span, wall_ms, write_json
from bench.specfold import forced_gate, model_8b, tree_blocks
from transformers import AutoModelForCausalLM, AutoTokenizer

from specfold_plugin.fold import folded_forward
from specfold_plugin.specfold import agreement_summary, specfold_generate
from specfold_plugin.stats import FoldStats, projected_flops
from spiffy_plugin.calibrate import calibrate
from spiffy_plugin.decode import DecodeParams, generate
from spiffy_plugin.runtime import BlockDiffusionRunner, dllm_spec
from spiffy_plugin.spiffy import dense_verify, spiffy_generate


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, dev, iters: int, warmup: int = 3) -> float:
    return wall_ms(fn, dev, iters, warmup)


def run_e2e(model, evals, graph, deltas, ffn_gates, max_new, dev, log,
            backends=("torch",), capacities=("sync",)):
    rows, params = [], DecodeParams()

    def timed(name, fn):
        _sync(dev)
        t0 = time.perf_counter()
        res = [fn(x) for x in evals]
        _sync(dev)
        return res, time.perf_counter() - t0

    base, sec = timed("vanilla", lambda x: generate(model, x, params, max_new))
    ntok = sum(len(r.tokens) for r in base)
    rows.append({"decoder": "vanilla", "nfe": sum(r.nfe for r in base), "tokens": ntok,
                 "seconds": round(sec, 2), "tokens_per_s": round(ntok / sec, 1)})
    log(rows[-1])
    spiffy, sec = timed("spiffy", lambda x: spiffy_generate(model, x, graph, params, max_new))
    ref = [r.tokens for r in spiffy]
    rows.append({"decoder": "spiffy", "nfe": sum(r.nfe for r in spiffy), "tokens": ntok,
                 "identical_to_vanilla": ref == [r.tokens for r in base],
                 "seconds": round(sec, 2), "tokens_per_s": round(ntok / sec, 1)})
    log(rows[-1])
    bs = dllm_spec(model.config).block_size
    if "triton" in backends:  # the kernel backend's fair baseline: dense on the same kernels
        from specfold_plugin.fold_fast import dense_forward_fast

        def dense_kernels(runner, blocks, parents):
            return dense_forward_fast(runner, blocks)
        # warm-up (not timed): compile the dense and the folded kernels once
        spiffy_generate(model, evals[0], graph, params, 32, verify=dense_kernels)
        specfold_generate(model, evals[0], graph, params, 32, delta=max(deltas), backend="triton")
        got, sec = timed("spiffy-kernels", lambda x: spiffy_generate(
            model, x, graph, params, max_new, verify=dense_kernels))
        rows.append({"decoder": "spiffy", "backend": "triton", "nfe": sum(r.nfe for r in got),
                     "tokens": ntok, **agreement_summary([r.tokens for r in got], ref),
                     "seconds": round(sec, 2), "tokens_per_s": round(ntok / sec, 1)})
        log(rows[-1])
    variants = [(b, c) for b in backends  # capacity: the kernel backend only
                for c in (capacities if b == "triton" else ["sync"])]
    for (backend, capacity), ffn_gate, delta in product(variants, ffn_gates, deltas):
        try:
            got, sec = timed("specfold", lambda x, d=delta, f=ffn_gate, be=backend, c=capacity:
                             specfold_generate(model, x, graph, params, max_new, delta=d,
                                               ffn_gate=f, backend=be, capacity=c))
            stats = FoldStats(model.config.num_hidden_layers)
            for r in got:
                if r.fold is not None:
                    stats.merge(r.fold)
            toks = sum(len(r.tokens) for r in got)
            rows.append({"decoder": "specfold", "backend": backend, "delta": delta,
                         **({"capacity": capacity} if backend == "triton" else {}),
                         "ffn_gate": ffn_gate,
                         "nfe": sum(r.nfe for r in got), "tokens": toks,
                         **agreement_summary([r.tokens for r in got], ref), **stats.summary(),
                         "projected_flop_saving": projected_flops(model.config, stats,
                                                                  bs)["saving"],
                         "seconds": round(sec, 2), "tokens_per_s": round(toks / sec, 1)})
            log(rows[-1])
        except Exception:  # noqa: BLE001 - report and go on
            traceback.print_exc()
    return rows


def _greedy_step(logits, masked):  # [n, vocab], [n] bool -> (position, token)
    conf, tok = torch.softmax(logits, -1).max(-1)
    pos = int(conf.masked_fill(~masked, -1.0).argmax())
    return pos, int(tok[pos])


def run_steps(model, evals, graph, deltas, max_new, log):
    """Local error, no compounding: decoding follows Spiffy's dense logits; in every verify
    forward, each draft's next greedy step (most confident masked position, its token) is taken
    from dense and from folded logits and compared."""
    mask_id = dllm_spec(model.config).mask_token_id
    rows = []
    for delta in deltas:
        count = [0, 0]

        def shadow(runner, blocks, parents, delta=delta, count=count):
            dense = dense_verify(runner, blocks, parents)
            folded = folded_forward(runner, blocks, parents, delta)
            runner.nfe -= 1
            masked = (blocks == mask_id).to(dense.device)
            for i in range(1, len(parents)):
                if masked[i].any():
                    count[1] += 1
                    count[0] += _greedy_step(dense[i], masked[i]) == _greedy_step(folded[i],
                                                                                   masked[i])
            return dense
        try:
            for x in evals:
                spiffy_generate(model, x, graph, DecodeParams(), max_new, verify=shadow)
            rows.append({"delta": delta, "draft_steps": count[1],
                         "step_agreement": round(count[0] / max(count[1], 1), 4)})
            log(rows[-1])
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    return rows


def latency_rows(runner, blocks, parents, deltas, ratios, dev, iters, label):
    """Dense vs folded verify latency of one branch batch; real gate (`ratios` None) or forced."""
    nfe = runner.nfe
    dense = time_ms(lambda: dense_verify(runner, blocks, parents), dev, iters)
    out = []
    for delta in deltas:
        try:
            stats = FoldStats(len(runner.model.model.layers))
            kw = {} if ratios is None else {"gate_fn": forced_gate(ratios[delta], dev)}
            folded_forward(runner, blocks, parents, delta, stats, **kw)
            ms = time_ms(lambda kw=kw, d=delta: folded_forward(runner, blocks, parents, d, **kw),
                         dev, iters)
            out.append({"shape": label, "branches": len(parents) - 1, "context": runner.cached,
                        "delta": delta, "dense_ms": round(dense, 3), "folded_ms": round(ms, 3),
                        "speedup": round(dense / ms, 3),
                        "fold_qkv_drafts": round(stats.fold_ratio("qkv", True), 4),
                        "fold_ffn_drafts": round(stats.fold_ratio("ffn", True), 4),
                        "forced_ratio": ratios is not None})
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    runner.nfe = nfe
    return out


def run_latency(model, prompt, graph, deltas, branches, max_new, dev, iters, samples, log):
    """Time verify forwards at real decoding states: every 4th forward with all drafts kept."""
    rows = []
    for b in branches:
        seen = [0]

        def probe(runner, blocks, parents, b=b, seen=seen):
            if len(parents) == b + 1 and seen[0] < samples * 4:
                seen[0] += 1
                if seen[0] % 4 == 0:
                    rows.extend(latency_rows(runner, blocks, parents, deltas, None, dev, iters,
                                             "fixture"))
            return dense_verify(runner, blocks, parents)
        try:
            spiffy_generate(model, prompt, graph, DecodeParams(), max_new, keep=b, verify=probe)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    summary = []
    for b in branches:
        for delta in deltas:
            sel = [r for r in rows if r["branches"] == b and r["delta"] == delta]
            if sel:
                summary.append({k: statistics.median(r[k] for r in sel) for k in (
                    "dense_ms", "folded_ms", "speedup", "fold_qkv_drafts", "fold_ffn_drafts")}
                    | {"shape": "fixture", "branches": b, "delta": delta, "samples": len(sel)})
                log(summary[-1])
    return summary


def run_8b(layers, context, deltas, branches, ratios, dev, iters, log):
    model = model_8b(layers, dev)
    spec = dllm_spec(model.config)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        runner = BlockDiffusionRunner(model, spec)
        root = torch.randint(3, 150000, (spec.block_size,), generator=gen)
        root[6:] = spec.mask_token_id
        runner.forward(torch.randint(3, 150000, (context,), generator=gen), root[None])
        for b in branches:
            blocks, parents = tree_blocks(root, b)
            got = latency_rows(runner, blocks, parents, deltas, ratios, dev, iters,
                               f"qwen3-8b-{layers}L")
            for r in got:
                log(r)
            rows += got
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(fixture("code-dllm")), help="model folder")
    p.add_argument("--prompts", default=str(DEV_PROMPTS))
    p.add_argument("--calib", default="32:40")
    p.add_argument("--eval", default="0:8")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--budget", type=int, default=10, help="D: draft graph nodes")
    p.add_argument("--deltas", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3])
    p.add_argument("--ffn-gates", nargs="+", default=["own"], choices=["own", "layer"])
    p.add_argument("--branches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--sections", nargs="+", default=["e2e", "steps", "latency", "8b"])
    p.add_argument("--step-prompts", type=int, default=4, help="eval prompts for `steps`")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--samples", type=int, default=5, help="decoding states timed per D*")
    p.add_argument("--layers-8b", type=int, default=36)
    p.add_argument("--context-8b", type=int, default=1024)
    p.add_argument("--backends", nargs="+", default=["torch"], choices=["torch", "triton"],
                   help="SpecFold's verify backends in the e2e section")
    p.add_argument("--capacities", nargs="+", default=["sync"], choices=["plan", "sync"],
                   help="the kernel backend's capacity modes in the e2e section")
    p.add_argument("--out", required=True, help="folder for specfold.json")
    a = p.parse_args()
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"run": run_info(dev), "dtype": str(dtype), "args": vars(a)}

    def log(row):
        print(json.dumps(row), flush=True)

    def save():
        write_json(out / "specfold.json", result)

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(dev).eval()
    prompts = read_prompts(a.prompts)
    cut = [span(s) for s in (a.calib, a.eval)]
    calib, evals = ([tok(x).input_ids for x in prompts[c]] for c in cut)
    graph = calibrate(model, calib, a.budget, DecodeParams(), a.max_new_tokens)
    result["graph_nodes"] = len(graph.nodes)
    if "e2e" in a.sections:
        result["e2e"] = run_e2e(model, evals, graph, a.deltas, a.ffn_gates, a.max_new_tokens,
                                dev, log, a.backends, a.capacities)
        save()
    if "steps" in a.sections:
        result["step_agreement"] = run_steps(model, evals[: a.step_prompts], graph, a.deltas,
                                             a.max_new_tokens, log)
        save()
    if dev.type == "cuda" and "latency" in a.sections:
        result["latency_fixture"] = run_latency(model, evals[0], graph, a.deltas, a.branches,
                                                a.max_new_tokens, dev, a.iters, a.samples, log)
        save()
    if dev.type == "cuda" and "8b" in a.sections:
        observed = {r["delta"]: (r["fold_qkv_drafts"], r["fold_ffn_drafts"])
                    for r in result.get("e2e", []) if r.get("ffn_gate") == "own"}
        ratios = {d: observed.get(d, (0.0, 0.0)) for d in a.deltas}
        result["fold_ratios_forced_8b"] = {str(d): r for d, r in ratios.items()}
        del model
        torch.cuda.empty_cache()
        try:
            result["latency_8b"] = run_8b(a.layers_8b, a.context_8b, a.deltas, a.branches,
                                          ratios, dev, a.iters, log)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        save()
    save()
    print(f"wrote {out / 'specfold.json'}")


if __name__ == "__main__":
    main()
