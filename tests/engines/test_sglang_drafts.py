"""Spiffy's acceptance rule as the SGLang adapter applies it (`sglang_drafts.advance`), without
SGLang: SGLang's canvas protocol in miniature, with our runtime as the forward. Each forward
scores the root canvas and its drafts; a block ends when `advance` reports it done, either in the
forward that scored its final canvas (SGLang persists K/V that way) or, when a scored draft IS
the final canvas, at once. Output must equal vanilla decoding; forwards must be fewer."""

import pytest
import torch

from spiffy_plugin.calibrate import calibrate
from spiffy_plugin.decode import generate
from spiffy_plugin.engines.sglang import SpiffyConfig
from spiffy_plugin.engines.sglang_drafts import CanvasState, Draft, advance, drafts_to_score
from spiffy_plugin.graph import DraftGraph, Node
from spiffy_plugin.params import DecodeParams
from spiffy_plugin.runtime import BlockDiffusionRunner, dllm_spec
from tests.spiffy.test_runtime import dllm  # noqa: F401 (module fixture)

PROMPTS = ["def fibonacci(n):",
           "class Stack:\n    \"\"\"A stack.\"\"\"\n\n    def push(self, item):"]
CHAIN = DraftGraph((Node.of([(0, 0)], 1), Node.of([(0, 1)], 1), Node.of([(0, 0), (1, 0)], 2),
                    Node.of([(0, 0), (1, 0), (2, 0)], 3)), (4, 1, 3, 2), 16, 16384, "vanilla-1")


def config(graph, spec, params, keep=None) -> SpiffyConfig:
    return SpiffyConfig(graph, "-", keep or len(graph.nodes), params, spec.mask_token_id,
                        spec.eos_token_id, spec.banned_token_ids)


@torch.inference_mode()
def serve(model, prompt, cfg, max_new_tokens, max_drafts=99, final_from_draft=True):
    """(tokens, forwards, steps, blocks) of one request decoded the way the adapter does it."""
    spec = dllm_spec(model.config)
    bs, runner = spec.block_size, BlockDiffusionRunner(model, spec)
    start = len(prompt) // bs * bs
    pending, tail, out = torch.tensor(prompt[:start], dtype=torch.long), prompt[start:], []
    steps = blocks = 0
    while len(out) < max_new_tokens and spec.eos_token_id not in out:
        ids = torch.tensor(tail + [spec.mask_token_id] * (bs - len(tail)))
        state = CanvasState(torch.arange(bs) < len(tail))
        while True:
            scored = drafts_to_score(state, ids)[:max_drafts]
            logits = runner.forward(pending, torch.stack([ids] + [d.ids for d in scored]))
            pending = pending[:0]
            done = advance(ids, logits[0], scored, logits[1:], state, cfg, final_from_draft)
            if done.kv_from is not None:
                assert torch.equal(scored[done.kv_from].ids, ids)
            if done.done:
                break
        steps, blocks = steps + state.steps, blocks + 1
        out += ids[len(tail):].tolist()
        pending, tail = ids, []
    eos = spec.eos_token_id
    return (out[: out.index(eos) + 1] if eos in out else out), runner.nfe, steps, blocks


@pytest.fixture(scope="module")
def threshold_graph(dllm):  # noqa: F811
    model, tok = dllm
    return calibrate(model, [tok("def merge_sort(items):").input_ids], 6,
                     DecodeParams(threshold=0.9), max_new_tokens=32)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_vanilla_rule_identical_with_fewer_forwards(dllm, prompt):  # noqa: F811
    model, tok = dllm
    ids = tok(prompt).input_ids
    spec, params = dllm_spec(model.config), DecodeParams(unmask_per_step=1)
    n = 48 - len(ids) % 16  # SGLang fills whole blocks
    ref = generate(model, ids, params, n)
    got, forwards, steps, blocks = serve(model, ids, config(CHAIN, spec, params), n)
    assert got == ref.tokens
    assert steps == ref.steps  # the same denoising trajectory as vanilla
    assert forwards < 0.75 * (steps + blocks)  # one-step decoding: a forward per step + commit
    plain = serve(model, ids, config(CHAIN, spec, params), n, max_drafts=0)
    assert plain == (ref.tokens, steps + blocks, steps, blocks)  # no drafts: one step/forward


def test_threshold_rule_and_pruned_drafts(dllm, threshold_graph):  # noqa: F811
    model, tok = dllm
    ids = tok(PROMPTS[0]).input_ids
    spec, params = dllm_spec(model.config), DecodeParams(threshold=0.9)
    ref = generate(model, ids, params, 48 - len(ids) % 16)
    for keep, max_drafts, final in ((None, 99, True), (2, 99, False), (None, 1, True)):
        cfg = config(threshold_graph, spec, params, keep)
        got, forwards, steps, blocks = serve(model, ids, cfg, 48 - len(ids) % 16, max_drafts,
                                             final)
        assert got == ref.tokens and steps == ref.steps
        assert forwards <= steps + blocks


def test_generated_eos_ends_the_block_like_vanilla(dllm):  # noqa: F811
    model, tok = dllm
    ids = tok(PROMPTS[0]).input_ids
    params = DecodeParams(unmask_per_step=1)
    eos = generate(model, ids, params, 16).tokens[5]  # a token vanilla generates early
    old = model.config.eos_token_id
    model.config.eos_token_id = eos
    try:
        spec = dllm_spec(model.config)
        ref = generate(model, ids, params, 48 - len(ids) % 16)
        got, forwards, steps, blocks = serve(model, ids, config(CHAIN, spec, params), 48)
    finally:
        model.config.eos_token_id = old
    assert ref.stop_reason == "eos" and got == ref.tokens and steps == ref.steps


def test_drafts_of_another_canvas_are_not_scored():
    state = CanvasState(torch.zeros(4, dtype=torch.bool), [Draft(0, torch.tensor([1, 2, 3, 4]))],
                        torch.tensor([1, 2, 2, 2]))
    assert drafts_to_score(state, torch.tensor([1, 2, 2, 2])) == state.drafts
    assert drafts_to_score(state, torch.tensor([1, 2, 2, 9])) == []
    assert drafts_to_score(CanvasState(torch.zeros(4, dtype=torch.bool)), torch.zeros(4)) == []
