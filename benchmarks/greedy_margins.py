"""Is a greedy output lossless? Teacher-forced margins of engine outputs under the fp32 target.

A lossless greedy decoder emits, at every position, the target's argmax given the tokens before
it (its own prefix, whatever it is). bf16 engines break near-ties differently from fp32, so an
output can differ from plain decoding without any bug. This check tells the two apart without a
GPU: it runs the target once per output (CPU, fp32) over prompt + output and, for every emitted
token, takes its margin = max logit - logit of the emitted token (0 when it is the fp32 argmax).
A near-tie flip has a margin of bf16's rounding size (the plain engine's own outputs show that
scale: they are lossless by definition); a verification bug shows as margins far above it.

Block-diffusion targets (a `--target` whose config has `dllm_block_size`, e.g. code-dllm; runs
of `gpu_dllm.py`, rows[].token_ids): the reference is one-step (vanilla-1) decoding, which
unmasks the most confident masked position per forward. The check replays each block in fp32
(`spiffy_plugin`'s runner, EOS ignored as in the runs) and at every step unmasks the position
whose emitted token costs least: cost = log-confidence of the most confident masked position -
log-probability of the emitted token at that position (0 when the output follows vanilla-1
exactly; a flip of the confidence order or of a token costs its gap). Each emitted token gets
the cost of its step. SGLang's LowConfidence at threshold 1.0 is that rule, so its own outputs
give the rounding scale, and Spiffy's (lossless by design) must stay within it.

Inputs: run JSONs of `gpu_tree_sglang.py` (rows[].tokens; prompts = the first dev prompts,
untruncated), `gpu_engines.py` (rows[].output_token_ids at T = 0) or `gpu_dllm.py`
(rows[].token_ids); prompts left-truncated to the JSON's `prompt_tokens` lengths when it has
them. Per run and row: tokens checked, tokens that are not the
fp32 argmax, their largest and median margin (logits), and the prompts with any margin above
--threshold.

    python benchmarks/greedy_margins.py --runs benchmarks/results/gpu-tree-sglang-v2/det/*.json \
        --out benchmarks/results/gpu-tree-sglang-v2/margins.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "examples" / "fixtures"
sys.path.insert(0, str(ROOT))  # this checkout's dflash_plugin


def run_outputs(doc: dict) -> list[dict]:
    """One entry per greedy row of a run JSON: {concurrency, outputs}."""
    rows = []
    for r in doc.get("rows", []):
        if "tokens" in r:  # gpu_tree_sglang
            rows.append({"concurrency": r["concurrency"], "outputs": r["tokens"]})
        elif "token_ids" in r:  # gpu_dllm (greedy only)
            rows.append({"concurrency": r["concurrency"], "outputs": r["token_ids"]})
        elif r.get("temperature", 0) == 0 and r.get("output_token_ids"):  # gpu_engines
            rows.append({"concurrency": r["concurrency"], "outputs": r["output_token_ids"]})
    return rows


def prompt_ids(doc: dict, tok, prompts_path: Path, n: int) -> list[list[int]]:
    """The run's prompts: the first `n` dev prompts, left-truncated to `prompt_tokens` when the
    JSON records them (gpu_engines)."""
    from dflash_plugin.training.data import load_prompts_jsonl

    texts = load_prompts_jsonl(prompts_path)[:n]
    ids = [tok(t).input_ids for t in texts]
    lens = doc.get("prompt_tokens")
    if lens:
        ids = [p[-k:] for p, k in zip(ids, lens)]
    return ids


@torch.no_grad()
def margins(model, prompt: list[int], output: list[int]) -> torch.Tensor:  # [len(output)]
    """max logit - logit of each emitted token, each given the prompt and the output before it."""
    ids = torch.tensor([prompt + output[:-1]])
    logits = model(ids).logits[0, len(prompt) - 1:].float()  # [len(output), vocab]
    out = torch.tensor(output)
    return logits.max(-1).values - logits.gather(1, out[:, None])[:, 0]


@torch.no_grad()
def block_margins(model, prompt: list[int], output: list[int]) -> torch.Tensor:  # [len(output)]
    """Each emitted token's cost against one-step (vanilla-1) block decoding (module doc)."""
    from dataclasses import replace

    from spiffy_plugin.runtime import BlockDiffusionRunner, dllm_spec

    spec = replace(dllm_spec(model.config), eos_token_id=None)  # the runs ignored EOS
    runner, bs, p = BlockDiffusionRunner(model, spec), spec.block_size, len(prompt)
    full = torch.tensor(prompt + output)
    limit, start = len(full), (p // bs) * bs
    cost_of = torch.zeros(len(output))
    clean = full[:start]
    while start < limit:
        have = full[start:start + bs]
        pos = start + torch.arange(bs)
        todo = (pos < limit) & (pos >= p)  # the block's generated positions, all masked
        ids = torch.full((bs,), spec.mask_token_id, dtype=torch.long)
        tail = max(0, p - start)  # the prompt's tail (first block only)
        ids[:tail] = have[:tail]
        want = ids.clone()
        want[: have.numel()] = have
        for step in range(int(todo.sum())):  # one unmasked position per forward
            logp = runner.forward(clean if step == 0 else ids[:0], ids[None])[0].log_softmax(-1)
            best = logp.max(-1).values.masked_fill(~todo, float("-inf")).max()
            cost = best - logp.gather(1, want[:, None])[:, 0]  # [bs]
            q = int(cost.masked_fill(~todo, float("inf")).argmin())
            cost_of[start + q - p] = cost[q].clamp(min=0)
            ids[q], todo[q] = want[q], False
        clean, start = ids, start + bs
    return cost_of


def summarize(m: list[torch.Tensor], threshold: float) -> dict:
    flat = torch.cat(m) if m else torch.zeros(0)
    bad = flat[flat > 0]
    return {"tokens": int(flat.numel()), "not_argmax": int(bad.numel()),
            "max_margin": float(bad.max()) if bad.numel() else 0.0,
            "median_margin": float(bad.median()) if bad.numel() else 0.0,
            "prompts_over_threshold": [i for i, x in enumerate(m)
                                       if x.numel() and float(x.max()) > threshold]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="+", required=True, help="run JSONs")
    p.add_argument("--target", default=str(FIX / "code-target"))
    p.add_argument("--prompts", default=str(FIX / "dev-prompts.jsonl"))
    p.add_argument("--threshold", type=float, default=0.5,
                   help="margin (logits) above which a prompt is listed")
    p.add_argument("--out", default=None, help="JSON of every run's summary")
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.target)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    score = block_margins if getattr(model.config, "dllm_block_size", None) else margins
    report = []
    print("| run | conc | tokens | not the fp32 argmax | max margin | median margin | "
          f"prompts over {a.threshold} |")
    print("|---|---|---|---|---|---|---|")
    for path in a.runs:
        doc = json.loads(Path(path).read_text())
        label = f"{Path(path).parent.name}/{Path(path).stem}"
        for row in run_outputs(doc):
            ids = prompt_ids(doc, tok, Path(a.prompts), len(row["outputs"]))
            m = [score(model, pr, out) for pr, out in zip(ids, row["outputs"]) if out]
            s = summarize(m, a.threshold)
            s.update(run=path, label=label, concurrency=row["concurrency"])
            report.append(s)
            print(f"| {label} | {row['concurrency']} | {s['tokens']} | "
                  f"{s['not_argmax']} | {s['max_margin']:.3f} | {s['median_margin']:.3f} | "
                  f"{s['prompts_over_threshold'] or '-'} |", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
