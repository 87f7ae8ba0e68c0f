"""The fast runtime's attention backends side by side: torch SDPA vs the `kernels` Triton
attention (issue 7), each with and without compiled pointwise ops (`compile_pointwise`).

    python benchmarks/fast_attention_bench.py --out $OUT/fa                          # H200, < 3 min
    python benchmarks/fast_attention_bench.py --device cpu --dry-run --out OUT      # logic check
Per (shape, context, batch, compile, attention), random weights, every row at `context` committed
tokens: CUDA-graph replay times of the target verify forward T(1) (no drafter), T(8), T(16) (with
the drafter's context write) and of the drafter block forward + LM head D(8), D(16); and the
implied speedup tau * T(1) / (T(B) + D(B)) at tau 3.85 and 4.5. Checks first: triton vs sdpa
verify logits on a ragged batch, and greedy `fast_generate` identity in fp32 (graphs on). Every
part runs in try/except; --budget-s skips what is left; DIR/results.partial.json follows along.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from pathlib import Path

import torch
from bench.common import DEV_PROMPTS, FIXTURES, checkout_first, read_prompts, run_info, write_json

checkout_first()

from bench.projection import QWEN3_8B, step_times  # noqa: E402

from dflash_plugin.fast.drafter import random_drafter  # noqa: E402
from dflash_plugin.fast.loop import FastDecoder, fast_generate  # noqa: E402
from dflash_plugin.fast.qwen3 import (  # noqa: E402
    Shape,
    compile_pointwise,
    random_target,
    target_forward,
)

FIX = FIXTURES
TAUS = (3.85, 4.5)
# the code-target fixture (8 layers) and its shipped 3-layer drafter, if its config is missing
FIXTURE = Shape(hidden=384, layers=8, heads=6, kv_heads=2, head_dim=64, intermediate=1152,
                vocab=16384, theta=10000.0)
TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=97)


def fixture_shape() -> tuple[Shape, int, tuple[int, ...]]:
    """(target shape, drafter layers, drafter target_layer_ids) from the fixtures' configs."""
    try:
        t = json.loads((FIX / "code-target" / "config.json").read_text())
        d = json.loads((FIX / "code-target-dflash-b16" / "config.json").read_text())
        theta = (t.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        s = Shape(t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"],
                  t["num_key_value_heads"], t["head_dim"], t["intermediate_size"],
                  t["vocab_size"], t["rms_norm_eps"], theta)
        return s, d["num_hidden_layers"], tuple(d["dflash_config"]["target_layer_ids"])
    except (OSError, KeyError, ValueError):
        return FIXTURE, 3, (1, 3, 5)


def weights(s: Shape, draft_layers: int, ids, dtype, device):
    ds = Shape(s.hidden, draft_layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab,
               s.eps, s.theta)
    return random_target(s, dtype, device), random_drafter(ds, s.hidden, ids, dtype, device)


def attempt(R: dict, name: str, fn, out_dir: Path):
    t0 = time.perf_counter()
    try:
        res = fn()
        print(f"[ok] {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
        return res
    except Exception as err:  # noqa: BLE001 - one variant must not stop the others
        print(f"[error] {name}: {err!r}", flush=True)
        traceback.print_exc()
        R["errors"][name] = repr(err)
        return None
    finally:
        write_json(out_dir / "results.partial.json", R)


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def check_logits(tw, dw, device, attentions) -> dict:
    """Verify logits (q = 16) and drafts of each backend vs sdpa, ragged batch of 4 rows."""
    lens = [37, 5, 20, 1]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, tw.shape.vocab, (n,), generator=gen).tolist() for n in lens]
    block = torch.randint(4, tw.shape.vocab, (4, 15), generator=gen).to(device)
    out = {}
    for a in attentions:
        # max_len 256 as in the identity check: the kernel specializes on it (page size)
        dec = FastDecoder(tw, dw, 4, 256, device, max_block=16, graphs=False, attention=a)
        dec.prefill(prompts, 8)
        dec.draft_ids.copy_(block)
        dec._verify(16)
        tids = dec.target_ids.clone()
        pos = dec.tcache.lengths[:, None] + torch.arange(16, device=device)
        ids = torch.cat([dec.anchor[:, None], block], 1)
        hn, _ = target_forward(tw, dec.tcache, dec.trope, ids, pos, pos + 1, (), a)
        dec._draft(16)
        out[a] = (torch.nn.functional.linear(hn, tw.lm_head).float(), tids,
                  dec.draft_ids.clone())
    ref = out["sdpa"]
    res = {}
    for a, (logits, tids, dids) in out.items():
        res[a] = {"max_abs_logit_diff": (logits - ref[0]).abs().max().item(),
                  "logit_scale": ref[0].abs().max().item(),
                  "verify_argmax_agree": (tids == ref[1]).float().mean().item(),
                  "draft_ids_agree": (dids == ref[2]).float().mean().item()}
    return res


@torch.inference_mode()
def check_identity(make, attentions, prompts, new_tokens, block) -> dict:
    """Greedy fast_generate of each backend (graphs on where CUDA) vs sdpa."""
    res = {}
    for a in attentions:
        r = fast_generate(make(a), prompts, block_size=block, max_new_tokens=new_tokens)
        res[a] = (r.tokens, [m.round_tokens for m in r.metrics.requests], r.metrics.tau)
    ref = res["sdpa"]
    return {a: {"tokens_identical": t == ref[0], "rounds_identical": rt == ref[1], "tau": tau}
            for a, (t, rt, tau) in res.items()}


def fixture_pair(device, dtype, batch, max_len):
    """FastDecoder factory over the real code-target fixture + drafter (needs transformers)."""
    from dflash_plugin.checkpoint import load_drafter
    from dflash_plugin.fast.drafter import draft_weights
    from dflash_plugin.fast.qwen3 import target_weights
    from dflash_plugin.loading import load_target

    model, tok = load_target(str(FIX / "code-target"), str(device), dtype)
    drafter = load_drafter(FIX / "code-target-dflash-b16", device, dtype)
    tw = target_weights(model)
    dw = draft_weights(drafter, tw.embed.dtype)
    texts = read_prompts(DEV_PROMPTS)[:batch]
    prompts = [tok(p).input_ids[:(i + 2) * max_len // (2 * batch + 2)]  # ragged rows
               for i, p in enumerate(texts)]
    return (lambda a: FastDecoder(tw, dw, batch, max_len, device, max_block=16, attention=a)), \
        prompts


def time_variant(tw, dw, batch, ctx, attention, iters, device) -> dict:
    t, d = {}, {}
    for drafter, qs in ((None, [1]), (dw, [8, 16])):
        dec = FastDecoder(tw, drafter, batch, ctx + 64, device, max_block=16, attention=attention)
        dec.tcache.reset(torch.full((batch,), ctx, device=device))
        st = step_times(dec, qs, iters)
        t.update(st["verify"])
        d.update(st["draft"])
        del dec
        free(device)
    proj = {f"B{b} tau {tau}": tau * t[1] / (t[b] + d[b]) for b in (8, 16) for tau in TAUS}
    return {"verify_ms": t, "draft_ms": d, "projection": proj}


def markdown(R: dict) -> str:
    lines = ["| shape | ctx | batch | compile | attention | T(1) | T(8) | T(16) | D(8) | D(16) | "
             "B16 @3.85 | B16 @4.5 | B8 @3.85 | B8 @4.5 |", "|" + "---|" * 14]
    for v in R["variants"]:
        t, d, p = v["verify_ms"], v["draft_ms"], v["projection"]
        lines.append(
            f"| {v['shape']} | {v['ctx']} | {v['batch']} | {v['compile']} | {v['attention']} | "
            + " | ".join(f"{x:.3f}" for x in (t[1], t[8], t[16], d[8], d[16])) + " | "
            + " | ".join(f"{p[f'B{b} tau {tau}']:.2f}x" for b in (16, 8) for tau in TAUS) + " |")
    lines += ["", "triton / sdpa time ratio (< 1: triton faster):", "",
              "| shape | ctx | batch | compile | T(1) | T(8) | T(16) | D(16) |", "|" + "---|" * 8]
    key = {(v["shape"], v["ctx"], v["batch"], v["compile"], v["attention"]): v
           for v in R["variants"]}
    for (sh, ctx, b, c, a), v in key.items():
        ref = key.get((sh, ctx, b, c, "sdpa"))
        if a != "triton" or ref is None:
            continue
        r = [v["verify_ms"][q] / ref["verify_ms"][q] for q in (1, 8, 16)]
        r.append(v["draft_ms"][16] / ref["draft_ms"][16])
        lines.append(f"| {sh} | {ctx} | {b} | {c} | " + " | ".join(f"{x:.2f}" for x in r) + " |")
    lines += ["", "Best per setting (AR baseline = fastest T(1); round = fastest T(16) + D(16)):",
              "", "| shape | ctx | batch | T(1) from | round from | B16 @3.85 | B16 @4.5 |",
              "|" + "---|" * 7]
    for sh, ctx, b in dict.fromkeys((v["shape"], v["ctx"], v["batch"]) for v in R["variants"]):
        vs = [v for v in R["variants"] if (v["shape"], v["ctx"], v["batch"]) == (sh, ctx, b)]
        ar = min(vs, key=lambda v: v["verify_ms"][1])
        rd = min(vs, key=lambda v: v["verify_ms"][16] + v["draft_ms"][16])
        den = rd["verify_ms"][16] + rd["draft_ms"][16]
        name = "{attention}/compile {compile}".format
        lines.append(f"| {sh} | {ctx} | {b} | {name(**ar)} | {name(**rd)} | " + " | ".join(
            f"{tau * ar['verify_ms'][1] / den:.2f}x" for tau in TAUS) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes, 2 iterations, compile off: checks the logic (CPU: minutes)")
    p.add_argument("--shapes", nargs="+", default=["fixture", "qwen3-8b"],
                   choices=["fixture", "qwen3-8b", "tiny"])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--compile-modes", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--attentions", nargs="+", default=["sdpa", "triton"],
                   choices=["sdpa", "triton"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="start no new variant after this many seconds (the rest is 'skipped')")
    p.add_argument("--skip-checks", action="store_true")
    args = p.parse_args()
    if "sdpa" not in args.attentions:
        args.attentions.insert(0, "sdpa")  # the reference of every check and ratio
    device = torch.device(args.device)
    if device.type == "cpu":  # specdec_kernels.attention is imported lazily: this reaches its @jit
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.dry_run:
        args.shapes, args.contexts, args.batches = ["tiny"], [24, 40], [1, 2]
        args.iters, args.compile_modes = 2, ["off"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    R = {"run": run_info(device), "triton": triton.__version__, "dtype": str(dtype),
         "args": vars(args), "checks": {}, "variants": [], "skipped": [], "errors": {}}
    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    fx_shape, fx_layers, fx_ids = fixture_shape()
    shapes = {"fixture": (fx_shape, fx_layers, fx_ids), "tiny": (TINY, 1, (1,)),
              "qwen3-8b": (QWEN3_8B, 5, (1, 9, 17, 25, 33))}  # build_target_layer_ids(36, 5)

    if not args.skip_checks:
        small = "tiny" if args.dry_run else "fixture"

        def logits():
            for dt in ([torch.float32] + ([dtype] if dtype != torch.float32 else [])):
                tw, dw = weights(*shapes[small], dt, device)
                R["checks"][f"logits {small} {dt}"] = c = check_logits(tw, dw, device,
                                                                       args.attentions)
                print("  ", dt, c)
        attempt(R, "check logits", logits, out_dir)

        def identity():
            if args.dry_run:
                tw, dw = weights(*shapes["tiny"], torch.float32, device)
                gen = torch.Generator().manual_seed(1)
                ps = [torch.randint(4, 97, (n,), generator=gen).tolist() for n in (5, 9)]
                make = lambda a: FastDecoder(tw, dw, 3, 48, device, attention=a)  # noqa: E731
                runs = [("tiny fp32", make, ps, 12)]
            else:
                runs = [("fixture fp32", *fixture_pair(device, torch.float32, 4, 256), 64)]
            for name, make, ps, n in runs:
                R["checks"][f"generate {name}"] = c = check_identity(make, args.attentions, ps,
                                                                     n, 16)
                print("  ", name, c)
        attempt(R, "check fast_generate identity", identity, out_dir)
        free(device)

    cache: dict = {}
    for mode in args.compile_modes:
        compile_pointwise(mode == "on")
        for sh in args.shapes:
            for ctx in args.contexts:
                for b in args.batches:
                    for a in args.attentions:
                        name = f"{sh} ctx{ctx} b{b} compile-{mode} {a}"
                        if time.perf_counter() - t_start > args.budget_s:
                            R["skipped"].append(name)
                            continue

                        def one(sh=sh, ctx=ctx, b=b, a=a, mode=mode, name=name):
                            if sh not in cache:
                                cache.clear()
                                free(device)
                                cache[sh] = weights(*shapes[sh], dtype, device)
                            r = time_variant(*cache[sh], b, ctx, a, args.iters, device)
                            R["variants"].append({"shape": sh, "ctx": ctx, "batch": b,
                                                  "compile": mode, "attention": a, **r})
                            print(f"  {name}: T {r['verify_ms']} D {r['draft_ms']}", flush=True)
                        attempt(R, name, one, out_dir)
    compile_pointwise(False)
    R["wall_seconds"] = time.perf_counter() - t_start
    write_json(out_dir / "results.json", R)
    table = attempt(R, "table", lambda: markdown(R), out_dir) or ""
    (out_dir / "table.md").write_text(table)
    print(table)
    print(f"wrote {out_dir} in {R['wall_seconds']:.0f} s; errors: {list(R['errors'])}; "
          f"skipped: {len(R['skipped'])}")


if __name__ == "__main__":
    main()
