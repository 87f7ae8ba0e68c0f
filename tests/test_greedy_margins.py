"""`benchmarks/greedy_margins.py` on the bundled targets (CPU, fp32): a greedy output has margin 0
at every token; one token swapped for the target's least likely one shows a large margin at
that position only; both run-JSON layouts give their greedy rows; the block-diffusion replay
(code-dllm) is 0 on one-step decoding and large on a changed token."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "examples" / "fixtures" / "code-target"


@pytest.fixture(scope="module")
def gm():
    spec = importlib.util.spec_from_file_location("_greedy_margins",
                                                  ROOT / "benchmarks" / "greedy_margins.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_greedy_is_zero_and_a_swapped_token_is_not(gm):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    prompt = [1, 400, 37, 1200, 9, 88]
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(12):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        m = gm.margins(model, prompt, out)
        assert m.shape == (12,) and torch.all(m == 0)
        bad = list(out)
        bad[5] = int(model(torch.tensor([prompt + out[:5]])).logits[0, -1].argmin())
    m = gm.margins(model, prompt, bad)
    assert torch.all(m[:5] == 0) and m[5] > 1.0
    s = gm.summarize([m], threshold=0.5)
    assert s["tokens"] == 12 and s["not_argmax"] >= 1 and s["prompts_over_threshold"] == [0]


def test_both_run_layouts(gm):
    tree = {"mode": "tree32", "rows": [{"concurrency": 1, "tokens": [[1, 2]]}]}
    engines = {"rows": [{"concurrency": 4, "temperature": 0.0, "output_token_ids": [[3]]},
                        {"concurrency": 4, "temperature": 1.0, "output_token_ids": [[4]]}]}
    assert gm.run_outputs(tree) == [{"concurrency": 1, "outputs": [[1, 2]]}]
    assert gm.run_outputs(engines) == [{"concurrency": 4, "outputs": [[3]]}]


def test_block_replay_is_zero_for_one_step_decoding_and_not_for_a_swapped_token(gm):
    """code-dllm (block diffusion): our reference's one-step (vanilla-1) output costs 0 at every
    token; another token at one position costs more than 1 nat there."""
    from transformers import AutoModelForCausalLM

    from spiffy_plugin.decode import generate
    from spiffy_plugin.params import DecodeParams

    dllm = ROOT / "examples" / "fixtures" / "code-dllm"
    model = AutoModelForCausalLM.from_pretrained(dllm, dtype=torch.float32).eval()
    prompt = list(range(100, 120))  # 20 tokens: a prompt tail inside the first block
    out = generate(model, prompt, DecodeParams(unmask_per_step=1), 24).tokens
    eos = model.config.eos_token_id
    if eos in out:
        out = out[: out.index(eos)]
    assert len(out) >= 12
    m = gm.block_margins(model, prompt, out)
    assert m.shape == (len(out),) and torch.all(m == 0)
    bad = list(out)
    bad[7] = (bad[7] + 1) % model.config.vocab_size  # another token at output position 7
    m = gm.block_margins(model, prompt, bad)
    assert float(m.max()) > 1.0
