"""Host time of DFLASH's decode-step preparation (SGLang 0.5.16's
`DFlashDraftInputV2.prepare_for_decode`) against `dflash_plugin.engines.sglang_decode_prep`
(DFLASH_FAST_DECODE_PREP), per call, at several batch sizes, side by side in one process.

Both run on the same requests, the same fresh draft input per step (as the scheduler hands them
over) and the same allocation stand-in (MOCK: SGLang's `alloc_for_spec_decode` needs a KV
allocator; the stand-in only raises each request's allocated length, the same for both), so the
difference is the preparation's own host work: on CUDA that includes DFLASH's pinned and device
buffer allocations per step and both sides' asynchronous copies; on CPU there is no pinned
memory, so the CPU numbers understate DFLASH's cost. Cold = the first call of each side; warm =
the mean over the timed steps after a warm-up, the two sides in alternating blocks.

    python benchmarks/decode_prep_bench.py --device cuda --out $R/decode-prep.json   # GPU host
    PYTHONPATH=.:.venv/sglang-0.5.16 python benchmarks/decode_prep_bench.py --device cpu
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def sglang_module():
    """SGLang's `dflash_info_v2` (the CPU test env of 0.5.16 has no torchvision: its test
    shims first)."""
    if importlib.util.find_spec("torchvision") is None:
        from tests.engines.sglang_env import legacy

        legacy.install()
    from sglang.srt.speculative import dflash_info_v2

    return dflash_info_v2


def requests(bs: int, w: int) -> list:
    return [types.SimpleNamespace(kv_committed_len=300 + 7 * i,
                                  kv=types.SimpleNamespace(kv_allocated_len=300 + 7 * i + 2 * w),
                                  sampling_params=types.SimpleNamespace(top_k=1))
            for i in range(bs)]


def batch_of(reqs, device):
    return types.SimpleNamespace(
        reqs=reqs, device=device, batch_size=lambda: len(reqs),
        token_to_kv_pool_allocator=types.SimpleNamespace(page_size=1), tree_cache=None,
        req_to_token_pool=None, req_pool_indices=torch.arange(len(reqs), device=device),
        spec_algorithm=types.SimpleNamespace(name="DFLASH_ADAPTIVE"))


def time_side(prepare, reqs, device, make_input, steps: int, grow: int) -> list[float]:
    """Seconds per call of `prepare(draft_input, batch)` over `steps` decode steps."""
    out = []
    for _ in range(steps):
        batch, di = batch_of(reqs, device), make_input(len(reqs))
        t = time.perf_counter()
        prepare(di, batch)
        out.append(time.perf_counter() - t)
        for r in reqs:
            r.kv_committed_len += grow
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--steps", type=int, default=500, help="timed steps per block")
    ap.add_argument("--blocks", type=int, default=4, help="alternating blocks per side")
    ap.add_argument("--w", type=int, default=16, help="the server's verify width W")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.blocks < 1 or min(args.batch) < 1:
        ap.error("--steps, --blocks and every --batch must be >= 1")
    dv2 = sglang_module()
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    from dflash_plugin.engines.sglang_decode_prep import prepare_for_decode

    device = torch.device(args.device)

    def alloc(tree_cache, pool, *, reqs, nxt_kv_lens_cpu, **kw):  # MOCK (module docstring)
        for r, n in zip(reqs, nxt_kv_lens_cpu.tolist()):
            r.kv.kv_allocated_len = max(r.kv.kv_allocated_len, n)

    dv2.alloc_for_spec_decode = alloc
    dv2.get_server_args = lambda: types.SimpleNamespace(speculative_num_draft_tokens=args.w)

    def make_input(bs):
        return make_draft_input_v2(bonus_tokens=torch.zeros(bs, dtype=torch.int64, device=device),
                                   new_seq_lens=torch.ones(bs, dtype=torch.int64, device=device))

    sides = {"dflash": dv2.DFlashDraftInputV2.prepare_for_decode, "ours": prepare_for_decode}
    rows = []
    for bs in args.batch:
        row = {"batch": bs}
        reqs = {name: requests(bs, args.w) for name in sides}
        for name, fn in sides.items():
            row[f"{name}_cold_us"] = 1e6 * time_side(fn, reqs[name], device, make_input, 1, 4)[0]
            time_side(fn, reqs[name], device, make_input, 50, 4)  # warm-up
        times = {name: [] for name in sides}
        for _ in range(args.blocks):
            for name, fn in sides.items():
                times[name] += time_side(fn, reqs[name], device, make_input, args.steps, 4)
        for name in sides:
            row[f"{name}_warm_us"] = 1e6 * sum(times[name]) / len(times[name])
        row["warm_ratio"] = row["ours_warm_us"] / row["dflash_warm_us"]
        rows.append(row)
        print(f"batch {bs:3d}: DFLASH {row['dflash_warm_us']:7.1f} us warm "
              f"({row['dflash_cold_us']:.0f} cold), ours {row['ours_warm_us']:7.1f} us "
              f"({row['ours_cold_us']:.0f} cold): {row['warm_ratio']:.2f}x", flush=True)
    doc = {"kind": "decode-prep-bench", "device": str(device),
           "device_name": torch.cuda.get_device_name() if device.type == "cuda"
           else platform.processor() or platform.machine(),
           "torch": torch.__version__, "w": args.w, "steps": args.steps, "blocks": args.blocks,
           "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
