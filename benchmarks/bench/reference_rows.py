"""The rows of `gpu_speedup.py` against the reference implementations: HF `generate` and the
z-lab `dflash` loop (PyPI dflash 0.1.0) at batch 1, ours re-timed on the same prompts
(`hf_rows`, `zlab_rows`, `ours_on_slow_rows`: group `slow`), the bf16 token agreement of every
pair of runs that should match (`agreement_checks`) and the fp32 token identity of our runtime
vs the reference loop, HF and z-lab (`fp32_checks`: group `fp32`). State: `bench.speedup_rows.
Speedup`.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from .common import _sync, agreement, checkout_first
from .fast_rows import run_ours
from .speedup_rows import Speedup

checkout_first()

from dflash_plugin.checkpoint import load_drafter  # noqa: E402
from dflash_plugin.fast import build_decoder, fast_generate  # noqa: E402
from dflash_plugin.generate import speculative_generate  # noqa: E402
from dflash_plugin.loading import load_target  # noqa: E402
from dflash_plugin.proposers import DFlashProposer  # noqa: E402


def zlab_module(device):
    """z-lab's `dflash.model` (PyPI dflash 0.1.0, installed --no-deps or in DFLASH_ORACLE_DIR)."""
    oracle = os.environ.get("DFLASH_ORACLE_DIR")
    if oracle and oracle not in sys.path:
        sys.path.insert(0, oracle)
    import dflash.model as zl

    if device != "cuda":
        zl._cuda_time = time.perf_counter  # their timer syncs CUDA
    return zl


def zlab_drafter(zl, ours):
    """Their drafter class with our weights (same checkpoint format)."""
    from transformers import Qwen3Config

    theirs = zl.DFlashDraftModel(Qwen3Config.from_dict(ours.config.to_dict()))
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs.to(ours.fc.weight.device, ours.fc.weight.dtype).eval()


def hf_rows(S: Speedup):
    """HF `generate` at batch 1 over the slow-row prompts (the first run warms up)."""
    model, slow, N, dev = S.model, S.slow, S.N, S.device
    secs, toks = [], []
    for ids in slow[:1] + slow:  # the first run warms up
        x = torch.tensor([ids], device=dev)
        _sync(dev)
        t0 = time.perf_counter()
        y = model.generate(x, do_sample=False, max_new_tokens=N, min_new_tokens=N,
                           pad_token_id=model.config.pad_token_id or 0)
        _sync(dev)
        secs.append(time.perf_counter() - t0)
        toks.append(y[0, len(ids):].tolist())
    secs, toks = secs[1:], toks[1:]
    S.outputs["hf"] = toks
    S.add_row("HF generate", 1, 1, {"seconds": sum(secs), "new_tokens": N * len(slow),
                                    "tokens_per_second": N * len(slow) / sum(secs),
                                    "tau": 1.0}, len(slow))


def zlab_rows(S: Speedup):
    """The z-lab loop at batch 1 per block size, our weights in their drafter class."""
    slow, N, dev = S.slow, S.N, S.device
    zl = zlab_module(dev)
    theirs = zlab_drafter(zl, S.drafter)
    for block in S.args.block_sizes:
        secs, toks, lens = [], [], []
        for ids in slow[:1] + slow:
            x = torch.tensor([ids], device=dev)
            _sync(dev)
            t0 = time.perf_counter()
            st = zl.dflash_generate(theirs, S.model, x, N, None, block_size=block,
                                    return_stats=True)
            _sync(dev)
            secs.append(time.perf_counter() - t0)
            toks.append(st.output_ids[0, len(ids):].tolist())
            lens.append(list(st.acceptance_lengths))
        secs, toks, lens = secs[1:], toks[1:], lens[1:]
        S.outputs[f"zlab-B{block}"] = toks
        rounds = sum(len(x) for x in lens)
        S.add_row("z-lab dflash 0.1.0", 1, block, {
            "seconds": sum(secs), "new_tokens": sum(map(len, toks)),
            "tokens_per_second": sum(map(len, toks)) / sum(secs),
            "tau": sum(map(sum, lens)) / rounds, "round_ms": sum(secs) / rounds * 1e3,
            "tau_per_prompt": [round(sum(x) / len(x), 3) for x in lens]}, len(slow))


def ours_on_slow_rows(S: Speedup):
    """Our AR and DFlash rows at batch 1 on the HF / z-lab rows' prompts."""
    slow = S.slow
    for kind, block, prop in [("plain", 1, "ar")] + [("dflash", b, "dflash")
                                                    for b in S.args.block_sizes]:
        r = run_ours(S.ready(kind, 1, slow), slow, 1, block, prop, S.N)
        S.outputs[f"slow-{prop}-B{block}"] = r["tokens"]
        S.add_row(f"ours {'AR' if prop == 'ar' else 'DFlash'} (slow-row prompts)", 1, block,
                  r, len(slow))


def agreement_checks(S: Speedup):
    """bf16 token agreement of the runs that should match (R["checks"]["bf16_agreement"])."""
    outputs = S.outputs
    a = S.R["checks"]["bf16_agreement"] = {}
    for key, ref in (("hf", "slow-ar-B1"), ("slow-dflash-B16", "slow-ar-B1"),
                     ("zlab-B16", "slow-dflash-B16"), ("zlab-B8", "slow-dflash-B8"),
                     ("zlab-B16", "hf")):
        if key in outputs and ref in outputs:
            a[f"{key} vs {ref}"] = agreement(outputs[key], outputs[ref])
    for k in outputs:
        if k.startswith(("dflash-", "ngram-")):
            b = k.rsplit("-b", 1)[1]
            if f"ar-b{b}" in outputs:
                a[f"{k} vs ar-b{b}"] = agreement(outputs[k], outputs[f"ar-b{b}"])


def fp32_checks(S: Speedup):
    """fp32 token identity: fast (graphs) vs reference loop vs HF (vs z-lab), on 4 prompts."""
    args, dev = S.args, S.device
    m32, _ = load_target(args.target, dev, torch.float32)
    d32 = load_drafter(args.drafter, dev, torch.float32)
    ps, n = S.prompts[:4], 64
    ref = speculative_generate(m32, DFlashProposer(d32), ps, block_size=16,
                               max_new_tokens=n, fast=False)
    dec = build_decoder(m32, d32, batch=4, max_len=S.width + n + 16, attention=args.attention)
    fast = fast_generate(dec, ps, block_size=16, max_new_tokens=n)
    hf_out = [m32.generate(torch.tensor([x], device=dev), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n, pad_token_id=0)[0, len(x):]
              .tolist() for x in ps]
    c = S.R["checks"]["fp32_identity"] = {
        "prompts": len(ps), "new_tokens": n,
        "fast_vs_reference": fast.tokens == ref.tokens, "fast_vs_hf": fast.tokens == hf_out,
        "round_tokens_equal": [r.round_tokens for r in fast.metrics.requests]
        == [r.round_tokens for r in ref.metrics.requests]}
    try:  # the z-lab loop, batch 1, same fp32 weights
        zl = zlab_module(dev)
        theirs = zlab_drafter(zl, d32)
        st = [zl.dflash_generate(theirs, m32, torch.tensor([x], device=dev), n, None,
                                 block_size=16, return_stats=True) for x in ps]
        c["fast_vs_zlab"] = fast.tokens == [s.output_ids[0, len(x):].tolist()
                                            for s, x in zip(st, ps)]
        c["round_tokens_equal_zlab"] = [r.round_tokens for r in fast.metrics.requests] == [
            list(s.acceptance_lengths) for s in st]
    except Exception as err:  # noqa: BLE001
        c["zlab_error"] = repr(err)
    print("  fp32:", c)
