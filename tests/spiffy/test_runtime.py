"""Block-diffusion runtime on the real code-dllm fixture (examples/fixtures/code-dllm)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spiffy_plugin.decode import DecodeParams, generate
from spiffy_plugin.errors import ConfigError
from spiffy_plugin.runtime import BlockDiffusionRunner, candidate_mask, dllm_spec

DLLM = Path(__file__).resolve().parents[2] / "examples" / "fixtures" / "code-dllm"


@pytest.fixture(scope="module")
def dllm():
    assert DLLM.is_dir(), f"fixture missing: {DLLM}"
    tok = AutoTokenizer.from_pretrained(DLLM)
    model = AutoModelForCausalLM.from_pretrained(DLLM, dtype=torch.float32).eval()
    return model, tok


def block_causal(n, bs):
    blk = torch.arange(n) // bs
    return blk[None, :] <= blk[:, None]


def full_logits(model, ids, bs):
    vis = block_causal(len(ids), bs)
    mask = torch.zeros(vis.shape).masked_fill(~vis, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), attention_mask=mask[None, None]).logits[0]


def test_candidate_mask_equals_naive():
    bs, cached, clean, k = 4, 8, 8, 3
    got = candidate_mask(clean, k, bs, cached)
    q = clean + k * bs
    for r in range(q):
        for c in range(cached + q):
            if c < cached:
                want = True
            else:
                j = c - cached
                if r < clean:
                    want = j < clean and j // bs <= r // bs
                else:
                    want = j < clean or (j // bs == r // bs)
            assert bool(got[r, c]) == want, (r, c)


def test_cached_forward_matches_full_recompute(dllm):
    model, _ = dllm
    spec = dllm_spec(model.config)
    bs = spec.block_size
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, 16000, (2 * bs,), generator=gen)
    blocks = torch.randint(3, 16000, (3, bs), generator=gen)
    blocks[:, 5:] = spec.mask_token_id
    runner = BlockDiffusionRunner(model, spec)
    first = runner.forward(ctx[:bs], blocks[:1])  # commit block 0, score a candidate at block 1
    got = runner.forward(ctx[bs:], blocks)  # commit block 1, score 3 candidates at block 2
    assert runner.nfe == 2 and runner.cached == 2 * bs
    want0 = full_logits(model, ctx[:bs].tolist() + blocks[0].tolist(), bs)[bs:]
    want0[:, list(spec.banned_token_ids)] = float("-inf")
    torch.testing.assert_close(first[0], want0, rtol=1e-4, atol=1e-4)
    for i in range(3):
        want = full_logits(model, ctx.tolist() + blocks[i].tolist(), bs)[2 * bs:]
        want[:, list(spec.banned_token_ids)] = float("-inf")
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)


def naive_decode(model, prompt, max_new, spec):
    """Recompute everything each step; unmask the single most confident position (greedy)."""
    bs, mask, eos = spec.block_size, spec.mask_token_id, spec.eos_token_id
    p = len(prompt)
    seq = list(prompt) + [mask] * (-(-(p + max_new) // bs) * bs - p)
    steps, b = 0, p // bs
    while True:
        s, e = b * bs, (b + 1) * bs
        while True:
            gen_pos = [i for i in range(max(s, p), min(e, p + max_new))]
            eos_at = [i for i in gen_pos if seq[i] == eos]
            todo = [i for i in gen_pos if seq[i] == mask and (not eos_at or i < eos_at[0])]
            if not todo:
                break
            logits = full_logits(model, seq[:e], bs)[s:e]
            logits[:, list(spec.banned_token_ids)] = float("-inf")
            conf, pred = logits.softmax(-1).max(-1)
            best = max(todo, key=lambda i: (conf[i - s].item(), -i))
            seq[best] = int(pred[best - s])
            steps += 1
        out = seq[p:min(e, p + max_new)]
        if eos in out:
            return out[: out.index(eos) + 1], steps
        if e >= p + max_new:
            return out[:max_new], steps
        b += 1


@pytest.mark.parametrize("prompt,max_new", [
    ("def fibonacci(n):", 40),  # prompt ends mid-block
    ("import numpy as np\n\n\ndef softmax(x, axis=-1):\n    \"\"\"Softmax.\"\"\"", 35),
])
def test_vanilla_greedy_matches_naive_decoder(dllm, prompt, max_new):
    model, tok = dllm
    spec = dllm_spec(model.config)
    ids = tok(prompt).input_ids
    res = generate(model, ids, DecodeParams(), max_new)
    want, steps = naive_decode(model, ids, max_new, spec)
    assert res.tokens == want
    assert res.nfe == res.steps == steps  # commits ride along with the next block's first step
    assert res.tokens_per_forward == pytest.approx(len(want) / steps)


def test_threshold_decoding(dllm):
    model, tok = dllm
    ids = tok("class Stack:\n    def __init__(self):").input_ids
    one = generate(model, ids, DecodeParams(threshold=1.0), 32)
    vanilla = generate(model, ids, DecodeParams(), 32)
    assert one.tokens == vanilla.tokens and one.nfe == vanilla.nfe  # nothing exceeds 1.0
    fast = generate(model, ids, DecodeParams(threshold=0.9), 32)
    assert fast.nfe < vanilla.nfe
    two = generate(model, ids, DecodeParams(unmask_per_step=2), 32)
    assert two.nfe <= -(-32 // 2) + 1


def test_sampling_is_seeded(dllm):
    model, tok = dllm
    ids = tok("def add(a, b):").input_ids
    a = generate(model, ids, DecodeParams(temperature=0.8, top_p=0.9, seed=3), 24)
    b = generate(model, ids, DecodeParams(temperature=0.8, top_p=0.9, seed=3), 24)
    assert a.tokens == b.tokens


@pytest.mark.parametrize("kwargs,field", [
    ({"threshold": 0.0}, "threshold"), ({"threshold": 1.5}, "threshold"),
    ({"unmask_per_step": 0}, "unmask_per_step"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
])
def test_bad_params(kwargs, field):
    with pytest.raises(ConfigError) as err:
        DecodeParams(**kwargs)
    assert err.value.field == field


def test_bad_checkpoint_and_prompt(dllm):
    model, _ = dllm
    cfg = model.config
    for name in ("dllm_block_size", "mask_token_id"):
        saved = getattr(cfg, name)
        delattr(cfg, name) if hasattr(cfg, name) else None
        try:
            with pytest.raises(ConfigError, match=name):
                dllm_spec(cfg)
        finally:
            setattr(cfg, name, saved)
    with pytest.raises(ConfigError, match="prompt"):
        generate(model, [], DecodeParams(), 8)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        generate(model, [5] * 4000, DecodeParams(), 200)
