"""How much error in the draft rows' logits can the fixture's decoding take before the output
changes? Token agreement with exact Spiffy against the draft rows' logit error, for SpecFold's
folding and for seeded random noise of known size (torch reference, CPU or GPU, fp32).

    PYTHONPATH=. python benchmarks/specfold_sensitivity.py --model examples/fixtures/code-dllm \
        --eval 0:16 --noise 1e-4 1e-3 1e-2 --deltas 0.02 0.1 --out DIR

Every row decodes the --eval prompts greedily with Spiffy's loop (D = --budget, calibrated on
--calib as in `specfold_bench.py`); only the verify forward differs:
- `noise eps`: dense verification whose draft rows (never the root) get, after every decoder
  layer, seeded Gaussian noise of relative size eps (||noise|| = eps ||h|| per row): a stand-in
  for any approximation of that size (a mock of error, not a real method);
- `specfold delta`: the folded forward (`fold.folded_forward`, parent gate, FFN gated on its own
  input);
- `bf16`: exact Spiffy with the model in bf16 (root rows rounded too), against the fp32 run.
*Logit error* = ||logits - dense logits|| / ||dense logits|| per draft row and position of a
verify forward, median and 90th percentile over all forwards (not measured for bf16).
*Agreement* = tokens equal to exact Spiffy's at the same index (a divergence counts against every
later token). Writes DIR/sensitivity.json.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import torch
from dllm_setup import add_args, load

from specfold_plugin.specfold import FoldedVerify, agreement_summary
from spiffy_plugin.runtime import BlockDiffusionRunner
from spiffy_plugin.spiffy import Verify, dense_verify, spiffy_generate


def noisy_layers(model, eps: float, block: int, seed: int = 0) -> list:
    """Forward hooks adding relative Gaussian noise to every row after the first block (the
    root's) of each decoder layer's output; returns the handles (remove them when done)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)

    def hook(_module, _args, out):
        h = out[0] if isinstance(out, tuple) else out  # [1, rows, d]
        drafts = h[:, block:]
        g = torch.randn(drafts.shape, generator=gen, device=h.device, dtype=torch.float32)
        g = g / g.norm(dim=-1, keepdim=True) * drafts.float().norm(dim=-1, keepdim=True) * eps
        h[:, block:] = (drafts.float() + g).to(h.dtype)
        return out

    return [layer.register_forward_hook(hook) for layer in model.model.layers]


class MeasuredVerify:
    """Wraps a verify forward: returns its logits and records each draft row's relative logit
    error against dense verification of the same blocks."""

    def __init__(self, inner: Verify):
        self.inner, self.errors = inner, []

    def __call__(self, runner: BlockDiffusionRunner, blocks: torch.Tensor,  # [k, block]
                 parents: list[int]) -> torch.Tensor:  # [k, block, vocab]
        exact = dense_verify(runner, blocks, parents)
        got = self.inner(runner, blocks, parents)
        runner.nfe -= 1  # the exact forward is a measurement, not decoding work
        ok = torch.isfinite(exact)
        e, g = exact.masked_fill(~ok, 0.0)[1:], got.masked_fill(~ok, 0.0)[1:]
        self.errors.append(((g - e).norm(dim=-1) / e.norm(dim=-1)).flatten().cpu())
        return got

    def quantiles(self) -> tuple[float, float]:
        err = torch.cat(self.errors) if self.errors else torch.zeros(1)
        return float(err.median()), float(err.quantile(0.9))


def noise_verify(eps: float, block: int) -> Verify:
    def verify(runner, blocks, parents):
        handles = noisy_layers(runner.model, eps, block)
        try:
            return dense_verify(runner, blocks, parents)
        finally:
            for h in handles:
                h.remove()
    return verify


def agreement_row(name: str, got: list[list[int]], ref: list[list[int]], nfe: int,
                  seconds: float, errors: tuple[float, float] | None) -> dict:
    row = {"decoder": name, **agreement_summary(got, ref), "nfe": nfe,
           "seconds": round(seconds, 1)}
    if errors is not None:
        row["logit_error_median"], row["logit_error_p90"] = (float(f"{e:.3g}") for e in errors)
    print(json.dumps(row), flush=True)
    return row


@torch.inference_mode()
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p, "0:16")
    p.add_argument("--noise", type=float, nargs="*", default=[1e-4, 1e-3, 1e-2])
    p.add_argument("--deltas", type=float, nargs="*", default=[0.02, 0.1])
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    model, evals, graph, params, n = load(a, a.device)
    block = model.config.dllm_block_size
    t0 = time.perf_counter()
    exact = [spiffy_generate(model, x, graph, params, n) for x in evals]
    ref = [r.tokens for r in exact]
    rows = [agreement_row("spiffy fp32", ref, ref, sum(r.nfe for r in exact),
                          time.perf_counter() - t0, None)]
    variants = [(f"noise {e:g}", noise_verify(e, block)) for e in a.noise]
    variants += [(f"specfold delta {d:g}", FoldedVerify(d)) for d in a.deltas]
    for name, inner in variants:
        verify, t0 = MeasuredVerify(inner), time.perf_counter()
        res = [spiffy_generate(model, x, graph, params, n, verify=verify) for x in evals]
        rows.append(agreement_row(name, [r.tokens for r in res], ref, sum(r.nfe for r in res),
                                  time.perf_counter() - t0, verify.quantiles()))
    if not a.no_bf16:
        half, t0 = model.to(torch.bfloat16), time.perf_counter()
        res = [spiffy_generate(half, x, graph, params, n) for x in evals]
        rows.append(agreement_row("spiffy bf16", [r.tokens for r in res], ref,
                                  sum(r.nfe for r in res), time.perf_counter() - t0, None))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sensitivity.json").write_text(json.dumps(
        {"date": str(date.today()), "device": a.device, "args": vars(a),
         "graph_nodes": len(graph.nodes), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
