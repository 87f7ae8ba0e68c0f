"""Prefill bucketing and warm-up of the fast runtime (CPU, fp32, no graphs): padding prompts to
a multiple of `prefill_bucket` changes no output token (batch 1 and 4, ragged prompts; DFlash,
n-gram, plain AR), and after `warmup()` a never-seen prompt length triggers no recompilation of
the compiled steps (dynamo counters, backend aot_eager: the same guards as inductor, no C
compiler needed)."""

import pytest
import torch
from torch._dynamo.utils import counters

from dflash_plugin.errors import ConfigError
from dflash_plugin.fast import accept as fast_accept
from dflash_plugin.fast import build_decoder, fast_generate
from tests.conftest import fitted_drafter, greedy_reference

PROMPTS = [[5, 17, 29, 41], [9, 8, 7, 6, 5, 4, 3, 2, 9], [11, 12], [20, 30, 40, 50, 60, 70, 80]]


@pytest.fixture(scope="module")
def pair(qwen3_target):
    return qwen3_target, fitted_drafter(qwen3_target, num_layers=1, block_size=8)


@pytest.mark.parametrize("batch", [1, 4])
def test_bucketed_prefill_is_token_identical(pair, batch):
    target, drafter = pair
    prompts = PROMPTS[:batch]
    greedy = greedy_reference(target, prompts, 24)
    for proposer, block in (("dflash", 8), ("ngram", 4), ("ar", 1)):
        outs = {}
        for bucket in (0, 16, 64):
            dec = build_decoder(target, drafter, batch=batch, max_len=96, graphs=False,
                                prefill_bucket=bucket)
            res = fast_generate(dec, prompts, block_size=block, max_new_tokens=24,
                                proposer=proposer)
            outs[bucket] = (res.tokens, [r.round_tokens for r in res.metrics.requests])
        assert outs[0] == outs[16] == outs[64], proposer
        assert outs[0][0] == greedy, proposer


def test_padded_widths_and_bad_bucket(pair):
    target, drafter = pair
    dec = build_decoder(target, drafter, batch=2, max_len=150, graphs=False, prefill_bucket=64)
    assert dec.max_len == 192 and dec.padded_width(1) == 64 and dec.padded_width(65) == 128
    assert dec.prefill_widths() == [64, 128, 192]  # 192: prompts up to max_len - block - 1
    assert dec.padded_width(180) == 192
    plain = build_decoder(target, drafter, batch=2, max_len=150, graphs=False, prefill_bucket=0)
    assert plain.padded_width(37) == 37 and plain.prefill_widths() == []
    with pytest.raises(ConfigError, match="prefill_bucket"):
        build_decoder(target, drafter, batch=1, max_len=64, graphs=False, prefill_bucket=-1)


def _compiled(monkeypatch):
    """compile_steps(True) with backend aot_eager (the CPU inductor needs a C toolchain)."""
    real = torch.compile

    def compile_(fn, **kw):
        return real(fn, **{**kw, "backend": "aot_eager"})
    monkeypatch.setattr(torch, "compile", compile_)
    fast_accept.compile_steps(True)


@pytest.mark.parametrize("batch", [1, 4])
def test_no_recompile_for_a_new_prompt_length_after_warmup(pair, monkeypatch, batch):
    target, drafter = pair
    torch._dynamo.reset()
    try:
        _compiled(monkeypatch)
        dec = build_decoder(target, drafter, batch=batch, max_len=128, graphs=False,
                            max_block=8)
        warm_s = dec.warmup()
        assert warm_s > 0
        before = dict(counters["stats"])
        frames = counters["stats"]["unique_graphs"]
        assert frames > 0  # the warm-up compiled something
        greedy = greedy_reference(target, [[7] * 3 + PROMPTS[1]] * batch, 20)
        for prompts in ([[7] * 3 + PROMPTS[1]] * batch, [p * 5 for p in PROMPTS[:batch]],
                        [[3]] * batch):  # 12, 10..35 and 1 tokens: widths never seen
            for proposer, block in (("dflash", 8), ("dflash", 5), ("ngram", 3), ("ar", 1)):
                res = fast_generate(dec, prompts, block_size=block, max_new_tokens=20,
                                    proposer=proposer)
                if prompts[0][0] == 7 and proposer == "dflash":
                    assert res.tokens == greedy
        assert counters["stats"]["unique_graphs"] == frames, {
            k: v - before.get(k, 0) for k, v in counters["stats"].items()}
    finally:
        fast_accept.compile_steps(False)
        monkeypatch.undo()
        torch._dynamo.reset()


def test_invariant_needs_cuda_or_the_interpreter(pair, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="invariant: needs a CUDA device"):
        build_decoder(pair[0], None, batch=1, max_len=16, graphs=False, invariant=True)
