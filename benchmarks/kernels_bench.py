"""Time the `kernels` ops against their torch references, SDPA and flex_attention.

    python benchmarks/kernels_bench.py --out benchmarks/results/kernels            # on the GPU
    python benchmarks/kernels_bench.py --device cpu --dry-run --out OUT        # logic check
Attention: 8 branches x 16 query tokens per request over a paged prefix (page 16) of 1k / 4k
tokens plus each branch's own 16-token block (dense block-diffusion mask), bf16, at the Qwen3-8B
head shape (32 / 8 / 128) and the code-dllm fixture's (6 / 2 / 64). GB/s counts the bytes that
must move at least once (prefix K/V once per request, blocks, q, out); the ceiling is a timed
device-to-device copy. Errors are max |x - fp32 reference| on the same inputs.
"""

from __future__ import annotations

import math
import platform
import traceback
from pathlib import Path

from bench.common import checkout_first, event_ms, kernel_args, run_info, write_json

ARGS = kernel_args(__doc__, lambda p: p.add_argument(
    "--no-flex", action="store_true", help="skip flex_attention (compile time)"))
checkout_first()

import torch  # noqa: E402
from specdec_kernels import reference as ref  # noqa: E402
from specdec_kernels.attention import _auto_splits, branch_attention  # noqa: E402
from specdec_kernels.gate import fold_plan, take_rows  # noqa: E402

DEV = torch.device(ARGS.device)
ITERS, WARMUP = (3, 1) if ARGS.dry_run else (ARGS.iters, 20)


def timed(fn) -> float:
    """Median milliseconds of fn() (`triton.testing.do_bench` on GPU; ITERS calls elsewhere)."""
    return event_ms(fn, DEV, ITERS, WARMUP)


def copy_ceiling_gbs() -> float:
    n = (1 << 20) if ARGS.dry_run else (1 << 29)  # 1 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6


def attn_case(rows, plen, h, kvh, d, nb=8, ql=16, ps=16, dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(0)
    pages_per_row = math.ceil(plen / ps)
    pages = rows * pages_per_row + 1

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEV, dtype)
    bt = torch.randperm(pages, generator=g)[: rows * pages_per_row].view(rows, pages_per_row)
    return dict(q=rnd(rows, nb, ql, h, d), k_cache=rnd(pages, ps, kvh, d),
                v_cache=rnd(pages, ps, kvh, d), block_table=bt.to(DEV, torch.int32),
                prefix_lens=torch.full((rows,), plen, dtype=torch.int32, device=DEV),
                k_blk=rnd(rows, nb, ql, kvh, d), v_blk=rnd(rows, nb, ql, kvh, d),
                blk_mask=torch.ones(nb, ql, ql, dtype=torch.bool, device=DEV))


def attn_bytes(c) -> int:
    rows, nb, ql, h, d = c["q"].shape
    kvh, plen = c["k_cache"].shape[2], int(c["prefix_lens"][0])
    elt = c["q"].element_size()
    return elt * (2 * rows * plen * kvh * d + 2 * c["k_blk"].numel() + 2 * c["q"].numel())


def materialised(c):
    """Per-branch copies for SDPA: q [R*nb, h, ql, d], k/v [R*nb, kvh, plen+bl, d], mask."""
    rows, nb, ql, h, d = c["q"].shape
    plen = int(c["prefix_lens"][0])
    ks, vs = [], []
    for r in range(rows):
        kp = ref.paged_prefix(c["k_cache"], c["block_table"][r], plen)
        vp = ref.paged_prefix(c["v_cache"], c["block_table"][r], plen)
        ks.append(torch.cat([kp[None].expand(nb, -1, -1, -1), c["k_blk"][r]], 1))
        vs.append(torch.cat([vp[None].expand(nb, -1, -1, -1), c["v_blk"][r]], 1))
    k = torch.stack(ks).flatten(0, 1).transpose(1, 2).contiguous()
    v = torch.stack(vs).flatten(0, 1).transpose(1, 2).contiguous()
    pm = torch.ones(nb, ql, plen, dtype=torch.bool, device=DEV)
    mask = torch.cat([pm, c["blk_mask"]], 2).repeat(rows, 1, 1)[:, None]
    return c["q"].flatten(0, 1).transpose(1, 2).contiguous(), k, v, mask


def flex_inputs(c, compiled: bool):
    """Shared prefix (one copy per request, not per branch) + all blocks as one key sequence;
    the BlockMask lets a branch see the prefix and its own block only."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    rows, nb, ql, h, d = c["q"].shape
    plen = int(c["prefix_lens"][0])
    bm_dense = c["blk_mask"]

    def keys(cache, blk):
        per = [torch.cat([ref.paged_prefix(cache, c["block_table"][r], plen),
                          blk[r].flatten(0, 1)]) for r in range(rows)]
        return torch.stack(per).transpose(1, 2).contiguous()  # [rows, kvh, plen+nb*ql, d]
    k, v = keys(c["k_cache"], c["k_blk"]), keys(c["v_cache"], c["v_blk"])
    q = c["q"].flatten(1, 2).transpose(1, 2).contiguous()  # [rows, h, nb*ql, d]

    def mask_mod(b, hh, qi, ki):
        kb = (ki - plen) // ql
        own = (kb == qi // ql) & bm_dense[qi // ql, qi % ql, (ki - plen).clamp(min=0) % ql]
        return (ki < plen) | ((ki >= plen) & own)
    bm = create_block_mask(mask_mod, rows, None, nb * ql, plen + nb * ql, device=str(DEV))
    fn = torch.compile(flex_attention) if compiled else flex_attention
    return (lambda: fn(q, k, v, block_mask=bm, enable_gqa=True)), q


PREFIX_ARGS = ("q", "k_cache", "v_cache", "block_table", "prefix_lens")
BLOCK_ARGS = ("q", "k_blk", "v_blk", "blk_mask")


def bench_attention(ceiling, records):
    shapes = [("8B", 32, 8, 128), ("code-dllm", 6, 2, 64)]
    prefixes, rows_list = ([40], [2]) if ARGS.dry_run else ([1024, 4096], [1, 8])
    for (name, h, kvh, d), plen, rows in [(s, p, r) for s in shapes for p in prefixes
                                          for r in rows_list]:
        if ARGS.dry_run:
            h, kvh, d = h // 2 or 1, kvh // 2 or 1, d
        c = attn_case(rows, plen, h, kvh, d, nb=3 if ARGS.dry_run else 8,
                      ql=4 if ARGS.dry_run else 16)
        shape = f"{name} h{h}/kv{kvh}/d{d} rows{rows} prefix{plen}"
        want = ref.attention(**{k: v.float() if v.is_floating_point() else v
                                for k, v in c.items()})[0]
        nbytes = attn_bytes(c)

        def run_sdpa(c=c):
            q, k, v, mask = materialised(c)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True)

        def to_ref_layout(o, c=c):  # [rows*nb, h, ql, d] or [rows, h, nb*ql, d] -> ref layout
            rows_, nb, ql, h_, d_ = c["q"].shape
            return o.reshape(rows_, nb, h_, ql, d_).transpose(2, 3) if o.shape[0] != rows_ \
                else o.reshape(rows_, h_, nb, ql, d_).permute(0, 2, 3, 1, 4)
        def folded_path(c=c):  # SpecFold: prefix state and own-block state, merged
            pre = branch_attention(**{k: c[k] for k in PREFIX_ARGS}, return_state=True,
                                   validate=False)
            blk = branch_attention(**{k: c[k] for k in BLOCK_ARGS}, return_state=True,
                                   validate=False)
            return ref.merge_states(*pre, *blk)[0]
        variants = {
            "triton branch_attention, 1 split": lambda c=c: branch_attention(
                **c, validate=False, num_splits=1),
            "triton branch_attention, auto splits": lambda c=c: branch_attention(
                **c, validate=False, num_splits=2 if ARGS.dry_run else None),
            "triton prefix + block partials, torch merge_states": folded_path,
            "torch reference (fp32)": lambda c=c: ref.attention(**c)[0],
            "sdpa, prefix copied per branch (copy timed)": run_sdpa,
        }
        pre = materialised(c)
        variants["sdpa, prefix copied per branch (copy not timed)"] = (
            lambda pre=pre: torch.nn.functional.scaled_dot_product_attention(
                pre[0], pre[1], pre[2], attn_mask=pre[3], enable_gqa=True))
        for label, compiled in (("flex_attention compiled, shared prefix", True),
                                ("flex_attention eager, shared prefix", False)):
            if ARGS.no_flex or compiled and (ARGS.dry_run or DEV.type != "cuda"):
                continue
            try:
                variants[label] = flex_inputs(c, compiled)[0]
            except Exception as e:
                records.append(dict(op="attention", shape=shape, variant=label, error=repr(e)))
        for label, fn in variants.items():
            rec = dict(op="attention", shape=shape, variant=label, bytes=nbytes)
            try:
                out = fn()
                out = out if out.dim() == 5 else to_ref_layout(out)
                rec["max_abs_err"] = float((out.float() - want).abs().max())
                rec["ms"] = timed(fn)
                rec["gbps"] = nbytes / rec["ms"] / 1e6
                rec["of_ceiling"] = rec["gbps"] / ceiling
                if "auto splits" in label and not ARGS.dry_run:
                    rows_, nb_, ql_, h_, _ = c["q"].shape
                    progs = math.ceil(nb_ * ql_ * (h_ // kvh) / 64) * rows_ * kvh
                    rec["num_splits"] = _auto_splits(
                        c["q"], progs, c["block_table"].shape[1] * c["k_cache"].shape[1], 64)
            except Exception as e:
                rec["error"] = repr(e)
                traceback.print_exc()
            records.append(rec)
            print(row_md(rec), flush=True)
        save(records)


def gate_cases(h, parent, x, plan, m):
    """(op, variant) -> (fn, bytes that must move)."""
    hb, xb = 2 * h.numel() * h.element_size(), 2 * x.numel() * x.element_size()
    return {
        ("fold_plan", "triton (4 launches)"): (
            lambda: fold_plan(h, parent, 0.1, validate=False), hb),
        ("fold_plan", "torch reference"): (lambda: ref.fold_plan(h, parent, 0.1), hb),
        ("gather rows", "triton take_rows"): (lambda: take_rows(x, plan.rows), xb),
        ("gather rows", "torch reference"): (lambda: ref.gather_rows(x, plan.rows), xb),
        ("scatter rows", "triton take_rows"): (lambda: take_rows(x[:m], plan.slot), xb),
        ("scatter rows", "torch reference"): (lambda: ref.scatter_rows(x[:m], plan.slot), xb),
    }


def bench_gate(ceiling, records):
    sizes = [(3, 4, 64)] if ARGS.dry_run else [(8, 16, 4096), (64, 16, 4096), (64, 16, 1024)]
    for nb, n, d in sizes:
        g = torch.Generator(device="cpu").manual_seed(0)
        parent = torch.tensor([-1] + [i // 2 for i in range(nb - 1)], dtype=torch.int32)
        h = torch.randn(nb, n, d, generator=g)
        for i in range(1, nb):
            near = torch.rand(n, 1, generator=g) < 0.5
            h[i] = h[parent[i]] + torch.where(near, 0.03, 1.0) * h[i]
        h, parent = h.to(DEV, torch.bfloat16), parent.to(DEV)
        shape = f"branches{nb} positions{n} dim{d}"
        want = ref.fold_plan(h, parent, 0.1)
        plan = fold_plan(h, parent, 0.1, validate=False)
        x = h.reshape(-1, d)
        m = int(plan.count)
        cases = gate_cases(h, parent, x, plan, m)
        exact = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(plan[1:], want[1:]))
        for (op, label), (fn, nbytes) in cases.items():
            rec = dict(op=op, shape=shape + f" folded {1 - m / x.shape[0]:.2f}", variant=label,
                       bytes=nbytes)
            if op == "fold_plan" and label.startswith("triton"):
                fin = torch.isfinite(want[0])
                rec["max_abs_err"] = float((plan.rho - want[0])[fin].abs().max())
                rec["exact_plan"] = rec["ok"] = exact
            try:
                rec["ms"] = timed(fn)
                rec["gbps"] = nbytes / rec["ms"] / 1e6
                rec["of_ceiling"] = rec["gbps"] / ceiling
            except Exception as e:
                rec["error"] = repr(e)
                traceback.print_exc()
            records.append(rec)
            print(row_md(rec), flush=True)


CHECKS = [  # rows, branches, q_len, blk_len, heads, kv_heads, dim, page, ragged prefix lens
    (2, 1, 3, 3, 4, 4, 64, 16, [37, 0]), (2, 7, 5, 6, 8, 1, 128, 64, [700, 5]),
    (3, 7, 2, 4, 8, 2, 64, 16, [1, 333, 16]), (1, 8, 16, 16, 32, 8, 128, 16, [4096]),
]


def check_case(rows, nb, ql, bl, h, kvh, d, ps, lens, dtype, seed):
    """Random inputs; pages no row uses are NaN (reading them would show). Random tree-ish mask."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per = max(1, max(math.ceil(n / ps) for n in lens))
    kc = torch.full((rows * per + 2, ps, kvh, d), math.nan)
    vc = kc.clone()
    bt = torch.randperm(rows * per + 2, generator=g)[: rows * per].view(rows, per).int()
    for r, n in enumerate(lens):
        for p in range(math.ceil(n / ps)):
            kc[bt[r, p]] = torch.randn(ps, kvh, d, generator=g)
            vc[bt[r, p]] = torch.randn(ps, kvh, d, generator=g)
    c = dict(q=torch.randn(rows, nb, ql, h, d, generator=g), k_cache=kc, v_cache=vc,
             block_table=bt, prefix_lens=torch.tensor(lens, dtype=torch.int32),
             k_blk=torch.randn(rows, nb, bl, kvh, d, generator=g),
             v_blk=torch.randn(rows, nb, bl, kvh, d, generator=g),
             blk_mask=torch.rand(rows, nb, ql, bl, generator=g) < 0.6,
             prefix_visible=torch.randint(0, max(lens) + 2, (rows, nb), generator=g).int())
    return {k: v.to(DEV, dtype) if v.is_floating_point() else v.to(DEV) for k, v in c.items()}


def correctness_checks(records):
    """Odd sizes, compiled: kernel vs reference (fp32 tol 1e-4 with TF32 off, bf16 3e-2)."""
    for i, shape in enumerate(CHECKS[:1] if ARGS.dry_run else CHECKS):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            for splits in (1, 3):
                rec = dict(op="check attention", shape=str(shape), variant=f"{dtype} S={splits}")
                try:
                    c = check_case(*shape, dtype, seed=i)
                    got = branch_attention(**c, return_state=True, num_splits=splits)
                    want = ref.attention(**{k: v.float() if v.is_floating_point() else v
                                            for k, v in c.items()})
                    errs = [float((a.float() - b).nan_to_num(0, 9e9, -9e9).abs().max())
                            for a, b in zip(got, want)]
                    fin = torch.isfinite(want[1])
                    errs[1] = float((got[1] - want[1])[fin].abs().max()) if fin.any() else 0.0
                    same_inf = torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
                    rec.update(max_abs_err=max(errs), ok=max(errs) <= tol and same_inf)
                except Exception as e:
                    rec.update(error=repr(e), ok=False)
                records.append(rec)
                print(f"| {rec['op']} | {rec['shape']} | {rec['variant']} | ok={rec['ok']} "
                      f"err={rec.get('max_abs_err', rec.get('error'))} | | | |", flush=True)


INFO: dict = {}


def save(records) -> None:
    """Rewrite the JSON after every configuration, so a run cut short still leaves its rows."""
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    INFO["all_checks_ok"] = all(r.get("ok", True) for r in records)
    write_json(out / "kernels_bench.json", dict(run=run_info(DEV), info=INFO, rows=records))


def row_md(r) -> str:
    if "error" in r:
        return f"| {r['op']} | {r['shape']} | {r['variant']} | error: {r['error'][:80]} | | | |"
    err = f"{r['max_abs_err']:.2e}" if "max_abs_err" in r else ""
    return (f"| {r['op']} | {r['shape']} | {r['variant']} | {r['ms'] * 1e3:.1f} | "
            f"{r['gbps']:.0f} | {100 * r['of_ceiling']:.1f}% | {err} |")


def main() -> None:
    info = INFO
    info.update(torch=torch.__version__, python=platform.python_version(), device=str(DEV),
                dry_run=ARGS.dry_run, iters=ITERS)
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        pass
    if DEV.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    ceiling = copy_ceiling_gbs()
    info["copy_ceiling_gbps"] = ceiling
    print(f"{info}\n\n| op | shape | variant | us | GB/s | of copy ceiling | max abs err |")
    print("|---|---|---|---|---|---|---|")
    records = []
    for part in (correctness_checks, bench_gate, bench_attention):
        try:
            part(records) if part is correctness_checks else part(ceiling, records)
        except Exception:
            traceback.print_exc()
        save(records)
    save(records)
    print(f"\nwrote {Path(ARGS.out) / 'kernels_bench.json'}; all checks ok: "
          f"{INFO['all_checks_ok']}")


if __name__ == "__main__":
    main()
