"""Teacher-forced per-offset accuracy and loss of DFlash drafters on token-shard folders.

    python benchmarks/drafter_eval.py --data DIR [DIR ...] --drafter NAME=DIR [NAME=DIR ...]
Each data folder is scored on its own (e.g. continuations of held-out prompts next to prompts from
packages the training never saw): the training recipe's block loss at random anchors (the same
`block_loss` as training, fixed seed, no gradient), so the numbers compare directly with the
`acc_per_offset` of a training summary. This separates a gap between train accuracy and held-out
acceptance into memorisation (unseen in-domain data scores low too) and domain shift (only the
held-out domain scores low). Writes --out (JSON) if given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dflash_plugin.checkpoint import load_drafter  # noqa: E402
from dflash_plugin.cli import load_target  # noqa: E402
from dflash_plugin.training.anchors import loss_weights, sample_anchors  # noqa: E402
from dflash_plugin.training.data import TokenDataset  # noqa: E402
from dflash_plugin.training.trainer import TrainConfig, block_loss  # noqa: E402


@torch.no_grad()
def evaluate(drafter, target, folder: str, limit: int, batch_size: int, device) -> dict:
    """Every sequence of `folder` (up to `limit`) once, 64 anchors each (fixed seed)."""
    bs = drafter.config.block_size
    cfg = TrainConfig(data=[folder], out="-", block_size=bs, num_anchors=64, max_seq_len=1024,
                      batch_size=batch_size, packed_attention="dense")
    ds = TokenDataset([folder], min_response=bs)
    weights = loss_weights(bs, cfg.gamma).to(device)
    gen = torch.Generator().manual_seed(1234)
    correct = total = loss_sum = 0
    count = min(limit, len(ds))
    starts = range(0, count, batch_size)
    for i in starts:
        ids, lengths, plens = ds.batch(list(range(i, min(i + batch_size, count))), 1024)
        anchors = torch.stack([sample_anchors(int(p), int(n), 64, gen)
                               for p, n in zip(plens, lengths)])
        loss, c, t = block_loss(drafter, target, ids.to(device), lengths.to(device),
                                anchors.to(device), cfg, drafter.config.mask_token_id, weights)
        correct, total, loss_sum = correct + c, total + t, loss_sum + float(loss)
    n = len(starts)
    acc = (correct / total.clamp_min(1)).tolist()
    return {"sequences": count, "loss": loss_sum / n,
            "acc_per_offset": [round(a, 4) for a in acc]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(ROOT / "examples/fixtures/code-target"))
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--drafter", nargs="+", required=True, help="NAME=DIR")
    p.add_argument("--limit", type=int, default=64, help="sequences per folder")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    target, _ = load_target(a.target, a.device, torch.float32)
    target.requires_grad_(False)
    res = {}
    for spec in a.drafter:
        name, path = spec.split("=", 1)
        drafter = load_drafter(path).to(a.device).float().eval()
        for folder in a.data:
            r = evaluate(drafter, target, folder, a.limit, a.batch_size, a.device)
            res[f"{name} on {folder}"] = r
            acc = r["acc_per_offset"]
            print(f"{name:>8} on {folder}: loss {r['loss']:.3f}  acc@1,2,4,8 "
                  f"{acc[1]:.3f} {acc[2]:.3f} {acc[4]:.3f} {acc[8]:.3f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
