"""SpecFold's gate measured against the parent (the issue's rule, `gate`) vs against the fold
source (`gate_vs_source`): token agreement with Spiffy and fold ratios, torch reference, fp32.

    python benchmarks/specfold_gate_ref.py --model examples/fixtures/code-dllm --eval 0:16 \
        --deltas 0.02 0.05 0.1 0.2 --out DIR

Draft graph calibrated as in `specfold_bench.py` (D = --budget on --calib prompts); every
(delta, gate) pair decodes the --eval prompts greedily; agreement = tokens equal to Spiffy's at
the same index (a divergence counts against every later token). Writes DIR/gate_ref.json.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import torch
from dllm_setup import add_args, load

from specfold_plugin.gate import gate, gate_vs_source
from specfold_plugin.specfold import FoldedVerify, agreement_summary
from spiffy_plugin.spiffy import spiffy_generate

GATES = {"parent": gate, "source": gate_vs_source}


@torch.inference_mode()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p, "0:16")
    p.add_argument("--deltas", type=float, nargs="+", default=[0.05, 0.1])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    model, evals, graph, params, n = load(a)
    ref = [spiffy_generate(model, x, graph, params, n).tokens for x in evals]
    rows = []
    for delta in a.deltas:
        for name, fn in GATES.items():
            verify = FoldedVerify(delta, "own", gate_fn=fn)
            t0 = time.perf_counter()
            got = [spiffy_generate(model, x, graph, params, n, verify=verify).tokens
                   for x in evals]
            rows.append({"delta": delta, "gate_ref": name, **agreement_summary(got, ref),
                         "fold_qkv_drafts": round(verify.stats.fold_ratio("qkv", True), 4),
                         "fold_ffn_drafts": round(verify.stats.fold_ratio("ffn", True), 4),
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gate_ref.json").write_text(json.dumps(
        {"date": str(date.today()), "device": "cpu", "dtype": "float32", "args": vars(a),
         "graph_nodes": len(graph.nodes), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
