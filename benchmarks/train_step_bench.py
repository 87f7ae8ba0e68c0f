"""Training-step throughput of the DFlash recipe: this checkout's trainer against an older one.

    python benchmarks/train_step_bench.py --data DIR --out $OUT/ts \\
        --old dflash_plugin.training.trainer_e3a12f7                     # H200
where the old module is written first with
    git show e3a12f7:dflash_plugin/training/trainer.py > dflash_plugin/training/trainer_e3a12f7.py
Variants: the old trainer, and this checkout's at each batch size without and with `compile`
(compiled elementwise ops). Each variant runs `train()` twice in one process on the same data
(the first, --warm-steps long, warms kernels and the allocator) and reports the second run's
sequence tokens/s and ms/step (the same tokens/s the training log prints). Then a torch profiler
table (top CUDA kernels) of a few steps of this checkout's `block_loss` + backward. Results:
DIR/train_step.json and profile.txt.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dflash_plugin.cli import load_target  # noqa: E402
from dflash_plugin.training import trainer as current  # noqa: E402


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_variant(module, target, data, out, batch, steps, warm_steps, device, compile=False):
    extra = {"compile": True} if compile else {}  # older trainers have no such field
    cfg = dict(**extra, data=data, num_layers=3, block_size=16, gamma=7.0, num_anchors=64,
               max_seq_len=1024, batch_size=batch, lr=1.2e-3, warmup_steps=10,
               init_from_target=True, packed_attention="dense", seed=5, mask_token_id=2,
               save_every=10**9, log_every=10**9)
    module.train(module.TrainConfig(out=str(out / "warm"), max_steps=warm_steps, **cfg),
                 target, device)
    sync(device)
    summary = module.train(module.TrainConfig(out=str(out / "timed"), max_steps=steps, **cfg),
                           target, device)
    sec = summary["seconds_this_run"]
    return {"module": module.__name__, "batch": batch, "compile": compile, "steps": steps,
            "ms_per_step": 1000 * sec / steps,
            "tokens_per_s": summary["tokens_per_second_this_run"],
            "final_loss": summary["final_loss"]}


def profile_steps(target, data, device, batch, n=4) -> str:
    from torch.profiler import ProfilerActivity, profile

    from dflash_plugin.checkpoint import config_for_target, init_drafter
    from dflash_plugin.training.anchors import loss_weights
    from dflash_plugin.training.data import TokenDataset

    cfg = current.TrainConfig(data=data, out="-", num_layers=3, batch_size=batch,
                              max_seq_len=1024, packed_attention="dense")
    ds = TokenDataset(data, min_response=16)
    dcfg = config_for_target(target.config, num_layers=3, block_size=16, mask_token_id=2)
    drafter = init_drafter(dcfg, seed=0).to(device).train()
    weights = loss_weights(16, 7.0).to(device)
    dev = torch.device(device)

    def step(i):
        ids, lengths, anchors, _ = current._step_batch(ds, cfg, i, 0, dev)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss, _, _ = current.block_loss(drafter, target, ids, lengths, anchors, cfg, 2,
                                            weights)
        loss.backward()
        drafter.zero_grad(set_to_none=True)

    for i in range(3):
        step(i)
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(n):
            step(100 + i)
        sync(device)
        wall = (time.perf_counter() - t0) / n
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    return f"profiled {n} steps (block_loss + backward, no optimizer): {wall * 1000:.1f} " \
           f"ms/step wall under the profiler\n{table}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(ROOT / "examples/fixtures/code-target"))
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--old", default=None, help="module of an older trainer to compare")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--compile", type=int, nargs="+", default=[0, 1],
                   help="this checkout's trainer without (0) / with (1) compiled pointwise ops")
    p.add_argument("--warm-steps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if torch.device(a.device).type == "cuda" else torch.float32
    target, _ = load_target(a.target, a.device, dtype)
    target.requires_grad_(False)
    rows = []
    modules = ([importlib.import_module(a.old)] if a.old else []) + [current]
    variants = [(m, b, False) for m in modules[:-1] for b in a.batches[:1]]
    variants += [(current, b, c) for c in a.compile for b in a.batches]
    for module, batch, comp in variants:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                rows.append(run_variant(module, target, a.data, Path(tmp), batch, a.steps,
                                        a.warm_steps, a.device, bool(comp)))
            except Exception as err:  # report and go on
                rows.append({"module": module.__name__, "batch": batch, "compile": bool(comp),
                             "error": repr(err)})
        print(json.dumps(rows[-1]), flush=True)
        (out / "train_step.json").write_text(json.dumps(rows, indent=2))
    try:
        text = profile_steps(target, a.data, a.device, a.batches[0])
    except Exception as err:
        text = f"profile failed: {err!r}"
    (out / "profile.txt").write_text(text)
    print(text[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
