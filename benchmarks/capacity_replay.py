"""Replay of SpecFold's capacity planning on recorded fold counts (CPU; no kernels run).

    PYTHONPATH=. python benchmarks/capacity_replay.py --model examples/fixtures/code-dllm \
        --eval 0:8 --deltas 0.05 0.1 --windows 1 4 8 16 --out DIR

Decodes the --eval prompts greedily with SpecFold's torch reference (fp32, D = --budget graph
calibrated on --calib) and records every verify forward's per-layer recompute counts. The counts
do not depend on the plan (the kernel backend re-runs a layer that overflowed), so each planner
(`fold_fast.CapacityPlanner` with a window / margin, one per prompt as in `specfold_generate`)
is replayed on them with the kernel backend's rule (`fold_fast.first_overflow`: re-run from the
first overflowing layer with every later layer at full capacity). Reports layers re-run (share
of the forwards' layers) and planned rows executed (QKV + FFN, re-runs included) over the rows
actually needed and over dense. Writes DIR/capacity_replay.json.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch
from dllm_setup import add_args, load

from specfold_plugin.fold_fast import CapacityPlanner, first_overflow
from specfold_plugin.specfold import FoldedVerify
from specfold_plugin.stats import FoldStats
from spiffy_plugin.spiffy import spiffy_generate

Forward = tuple[int, torch.Tensor]  # (branches, counts [layers, 2, 1])


class RecordingStats(FoldStats):
    """FoldStats that also keeps each forward's per-layer (QKV, FFN) counts."""

    def __post_init__(self):
        super().__post_init__()
        self.log: list[tuple[int, list[tuple[int, int]]]] = []

    def add_forward(self, rows: int, root_rows: int, context: int) -> None:
        super().add_forward(rows, root_rows, context)
        self.log.append((rows // root_rows, []))

    def add_layer(self, layer: int, qkv: int, ffn: int, context: int) -> None:
        super().add_layer(layer, qkv, ffn, context)
        self.log[-1][1].append((qkv, ffn))


def record(model, evals, graph, params, n: int, delta: float) -> list[list[Forward]]:
    """Per prompt, its verify forwards' counts."""
    out = []
    for x in evals:
        verify = FoldedVerify(delta)
        verify.stats = RecordingStats(len(model.model.layers))
        spiffy_generate(model, x, graph, params, n, verify=verify)
        out.append([(k, torch.tensor(c)[:, :, None]) for k, c in verify.stats.log])
    return out


def replay(prompts: list[list[Forward]], n: int, window: int, margin: float) -> dict:
    forwards = reruns = planned = needed = dense = 0
    for fwds in prompts:
        planner = CapacityPlanner(margin=margin, window=window)
        for k, counts in fwds:
            layers, full = counts.shape[0], k * n
            caps = planner.plan(k, n, layers)
            start = 0
            while True:
                planned += sum(a + b for a, b in caps[start:])
                j = first_overflow(counts, caps)
                if j is None:
                    break
                reruns += layers - j
                caps[j:] = [(full, full)] * (layers - j)
                start = j
            planner.update(k, n, counts)
            forwards += 1
            needed += int(counts.sum())
            dense += 2 * full * layers
    layers = prompts[0][0][1].shape[0]
    return {"window": window, "margin": margin, "forwards": forwards,
            "rerun_layers": round(reruns / (forwards * layers), 4),
            "planned_over_needed": round(planned / needed, 3),
            "planned_over_dense": round(planned / dense, 3),
            "needed_over_dense": round(needed / dense, 3)}


@torch.inference_mode()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p, "0:8")
    p.add_argument("--deltas", type=float, nargs="+", default=[0.05, 0.1])
    p.add_argument("--windows", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--margins", type=float, nargs="+", default=[0.0625, 0.125, 0.25])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    model, evals, graph, params, n = load(a)
    block = model.config.dllm_block_size
    rows = []
    for delta in a.deltas:
        counts = record(model, evals, graph, params, n, delta)
        for window in a.windows:
            for margin in a.margins:
                rows.append({"delta": delta, **replay(counts, block, window, margin)})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity_replay.json").write_text(json.dumps(
        {"date": str(date.today()), "device": "cpu", "args": vars(a), "rows": rows},
        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
