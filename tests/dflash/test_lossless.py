"""Greedy speculative decoding must be token-identical to plain decoding (fp32, CPU)."""

import pytest
import torch

from dflash_plugin.generate import speculative_generate
from dflash_plugin.proposers import DFlashProposer, ScriptedProposer
from tests.conftest import VOCAB, fitted_drafter, greedy_reference

# The first two are among the prompts the drafter was fitted on (long accepted runs); the others
# are new (mostly rejected drafts): a batch mixes both, so acceptance is ragged.
PROMPTS = [[5, 17, 29, 41], [7, 19, 31, 43], [9, 8, 7, 6, 5, 4], [60, 61], [11, 23, 35, 47, 2, 90]]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request, qwen3_target, llama_target):
    target = qwen3_target if request.param == "qwen3" else llama_target
    return target, fitted_drafter(target, num_layers=2, block_size=8)


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_identity(pair, block_size, batch):
    target, drafter = pair
    prompts = PROMPTS[:batch] if batch == 1 else PROMPTS[1:1 + batch]
    ref = greedy_reference(target, prompts, 40)
    res = speculative_generate(target, DFlashProposer(drafter), prompts,
                               block_size=block_size, max_new_tokens=40)
    assert res.tokens == ref
    m = res.metrics
    assert all(r.new_tokens == 40 for r in m.requests)
    assert 1.0 <= m.tau <= block_size
    if block_size >= 4:  # the fitted drafter is accepted at least sometimes
        assert m.tau > 1.0
        assert any(t < block_size for r in m.requests for t in r.round_tokens)


def test_batch_rows_are_ragged(pair):
    target, drafter = pair
    res = speculative_generate(target, DFlashProposer(drafter), PROMPTS, block_size=8,
                               max_new_tokens=40)
    taus = [r.tau for r in res.metrics.requests]
    assert max(taus) > 2 * min(taus)  # rows committed very different numbers per round
    assert res.tokens == greedy_reference(target, PROMPTS, 40)


@pytest.mark.parametrize("block_size", [4, 8])
def test_oracle_and_wrong_proposers(qwen3_target, block_size):
    prompts = PROMPTS[:3]
    n_rounds = 5
    max_new = 1 + n_rounds * block_size  # first token comes from prefill
    ref = greedy_reference(qwen3_target, prompts, max_new)
    lens = [len(p) for p in prompts]
    oracle = speculative_generate(qwen3_target, ScriptedProposer(ref, lens, VOCAB), prompts,
                                  block_size=block_size, max_new_tokens=max_new)
    wrong = speculative_generate(qwen3_target, ScriptedProposer(ref, lens, VOCAB, shift=1),
                                 prompts, block_size=block_size, max_new_tokens=max_new)
    assert oracle.tokens == ref and wrong.tokens == ref
    assert oracle.metrics.tau == block_size
    assert oracle.metrics.per_position_acceptance == [1.0] * (block_size - 1)
    assert wrong.metrics.tau == 1.0
    assert wrong.metrics.per_position_acceptance == [0.0] * (block_size - 1)


@pytest.mark.parametrize("use_drafter", [False, True])
def test_stop_token_mid_block(pair, use_drafter):
    target, drafter = pair
    prompts = PROMPTS[:3]
    free = greedy_reference(target, prompts, 30)
    stop = free[0][10]  # appears in row 0 at index 10: inside a block, not at its end
    ref = greedy_reference(target, prompts, 30, eos_token_id=stop)
    lens = [len(p) for p in prompts]
    proposer = DFlashProposer(drafter) if use_drafter else ScriptedProposer(free, lens, VOCAB)
    res = speculative_generate(target, proposer, prompts, block_size=8, max_new_tokens=30,
                               stop_token_ids=(stop,))
    assert res.tokens == ref
    assert res.tokens[0][-1] == stop and len(res.tokens[0]) <= 11
    assert res.metrics.requests[0].stop_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 7, 17])
def test_max_new_tokens_exact(pair, max_new):
    target, drafter = pair
    res = speculative_generate(target, DFlashProposer(drafter), PROMPTS[:2], block_size=8,
                               max_new_tokens=max_new)
    assert [len(t) for t in res.tokens] == [max_new, max_new]
    assert res.tokens == greedy_reference(target, PROMPTS[:2], max_new)


def test_drafter_cache_matches_recompute(pair):
    """Incremental drafting through the draft KV cache equals drafting with the whole context."""
    target, drafter = pair
    prompt = PROMPTS[0]
    ids = torch.tensor([prompt + greedy_reference(target, [prompt], 20)[0]])
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        from dflash_plugin.target import context_features

        feats = context_features(out.hidden_states, drafter.config.target_layer_ids)
        emb = target.get_input_embeddings()
        from dflash_plugin.draft_cache import DraftKVCache

        cache = DraftKVCache(len(drafter.layers))
        cuts = [4, 9, 10, 17]
        prev = 0
        for cut in cuts:
            block = torch.tensor([[ids[0, cut].item()] + [3] * 7])
            pos = torch.arange(cut, cut + 8)[None]
            ctx_pos = torch.arange(prev, cut)[None]
            inc = drafter(emb(block), pos, feats[:, prev:cut], ctx_pos, None, cache)
            full = drafter(emb(block), pos, feats[:, :cut], torch.arange(cut)[None], None, None)
            torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)
            prev = cut


def test_ngram_lookup():
    from dflash_plugin.ngram import ngram_lookup

    assert ngram_lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert ngram_lookup([1, 2, 3, 9, 2, 3, 7, 2, 3], 2) == [7, 2]  # latest match wins
    assert ngram_lookup([5, 6, 7], 2) == []


def test_ngram_proposer_is_lossless(pair):
    from dflash_plugin.ngram import NgramProposer

    target, _ = pair
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7, 6, 5, 4], [60, 61]]
    res = speculative_generate(target, NgramProposer(), prompts, block_size=8, max_new_tokens=40)
    assert res.tokens == greedy_reference(target, prompts, 40)
    assert res.metrics.tau > 1.0  # greedy continuations of tiny targets repeat themselves
