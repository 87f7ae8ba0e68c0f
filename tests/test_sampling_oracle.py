"""Our sampling transforms against transformers' logits warpers as an external oracle.

Oracle: SuppressTokensLogitsProcessor (banned ids) -> TemperatureLogitsWarper -> TopKLogitsWarper
(left out for k = 0, our "disabled") -> TopPLogitsWarper (left out for p = 1), then softmax: the
order `generate` applies them in. Ours: `dflash_plugin.sampling.sampling_probs` (temperature,
top-k, top-p) and `spiffy_plugin.decode.step_distribution` (temperature, top-p; banned ids are set
to -inf by the runtime before it, as `BlockDiffusionRunner.forward` does).

Checked on random fp32 logits, odd vocab sizes (111, 8193), batch 1 and 7: the support (which
ids keep non-zero probability) must be identical, the probabilities equal within
rtol 1e-5 / atol 1e-7 (fp32: HF masks then takes one softmax; we softmax, zero and renormalise).
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dflash_plugin.sampling import SamplingParams, sampling_probs
from spiffy_plugin.decode import DecodeParams, step_distribution

TOL = dict(rtol=1e-5, atol=1e-7)  # fp32 probabilities, see the module docstring

# (temperature, top_k (0 = off), top_p (1.0 = off))
COMBOS = [
    (1.0, 0, 1.0),  # plain softmax
    (0.7, 0, 0.9),
    (1.3, 0, 0.5),
    (1.0, 0, 0.01),  # only the top token survives
    (1.3, 50, 1.0),
    (0.5, 20, 0.8),
    (2.0, 5, 0.5),
    (0.9, 1, 1.0),  # top-1: one-hot
    (1.0, 200, 0.95),  # k above the small vocab: no top-k
    (1.0, 8193, 1.0),  # k = the large vocab: no top-k either
]
SHAPES = [(1, 111), (7, 111), (1, 8193), (7, 8193)]


def random_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 3.0


def oracle_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 banned: tuple[int, ...] = ()) -> torch.Tensor:
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)  # unused by these processors
    scores = logits.clone()
    if banned:
        scores = SuppressTokensLogitsProcessor(list(banned))(ids, scores)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return torch.softmax(scores, dim=-1)


def check_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got > 0, want > 0), "different support"
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[0]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch,vocab", SHAPES)
@pytest.mark.parametrize("temperature,top_k,top_p", COMBOS)
def test_dflash_sampling_probs_match_hf(batch, vocab, temperature, top_k, top_p):
    logits = random_logits(batch, vocab, seed=vocab + batch)
    got = sampling_probs(logits, SamplingParams(temperature, top_p, top_k))
    check_same(got, oracle_probs(logits, temperature, top_k, top_p))
    if 0 < top_k < vocab:
        assert (got > 0).sum(-1).max() <= top_k
    if top_k == 1 or top_p == 0.01:
        assert torch.equal(got.argmax(-1), logits.argmax(-1)) and (got > 0).sum() == batch


@pytest.mark.parametrize("batch,vocab", SHAPES)
@pytest.mark.parametrize("temperature,top_p", sorted({(t, p) for t, k, p in COMBOS if k == 0}))
@pytest.mark.parametrize("banned", [(), (0, 5, 110)])
def test_spiffy_step_distribution_matches_hf(batch, vocab, temperature, top_p, banned):
    logits = random_logits(batch, vocab, seed=vocab + batch)
    ours = logits.clone()
    if banned:
        ours[..., list(banned)] = float("-inf")  # what the runtime does before this step
    got = step_distribution(ours, DecodeParams(temperature=temperature, top_p=top_p))
    check_same(got, oracle_probs(logits, temperature, 0, top_p, banned))
    assert got[:, list(banned)].eq(0).all()


@pytest.mark.parametrize("batch,vocab", SHAPES)
@pytest.mark.parametrize("temperature,top_p", sorted({(t, p) for t, k, p in COMBOS if k == 0}))
def test_the_two_top_p_implementations_agree_bitwise(batch, vocab, temperature, top_p):
    """With top-k off the DFlash and Spiffy transforms run the same ops: identical output."""
    logits = random_logits(batch, vocab, seed=3 * vocab + batch)
    a = sampling_probs(logits, SamplingParams(temperature, top_p, 0))
    b = step_distribution(logits, DecodeParams(temperature=temperature, top_p=top_p))
    assert torch.equal(a, b)


@pytest.mark.parametrize("batch,vocab", SHAPES)
def test_greedy(batch, vocab):
    """Temperature 0 (no HF warper: TemperatureLogitsWarper refuses 0). DFlash maps it to the
    argmax one-hot; Spiffy's greedy step distribution is the untempered softmax with top-p
    ignored (its max is the confidence, its argmax the token)."""
    logits = random_logits(batch, vocab, seed=7)
    want = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    assert torch.equal(sampling_probs(logits, SamplingParams(0.0, 0.5, 5)), want)
    got = step_distribution(logits, DecodeParams(temperature=0.0, top_p=0.5))
    check_same(got, oracle_probs(logits, 1.0, 0, 1.0))
    assert torch.equal(got.argmax(-1), logits.argmax(-1))
