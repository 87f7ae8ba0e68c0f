"""Sampling is lossless in distribution: speculative samples follow the target's distribution.

Small vocabulary, 3 new tokens: we enumerate all V^3 continuations, compute their exact probability
under the (temperature / top-k / top-p transformed) target, and run a chi-square goodness-of-fit
test on many speculative samples drawn as one large batch. A negative control (a verifier that
accepts every draft, i.e. samples from the drafter) must be rejected by the same test.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

import dflash_plugin.generate as gen_mod
from dflash_plugin.checkpoint import config_for_target, init_drafter
from dflash_plugin.generate import speculative_generate
from dflash_plugin.proposers import DFlashProposer
from dflash_plugin.sampling import SamplingParams, sampling_probs
from tests.conftest import tiny_target

V, NEW, N = 8, 3, 30000
PROMPT = [4, 2, 6]


@pytest.fixture(scope="module")
def small():
    target = tiny_target("qwen3", vocab=V, seed=3, layers=2, std=0.5)
    cfg = config_for_target(target.config, num_layers=1, block_size=4, mask_token_id=7)
    return target, init_drafter(cfg, seed=5, std=0.5)


def exact_distribution(target, params):
    seqs = torch.tensor([PROMPT + list(s) for s in itertools.product(range(V), repeat=NEW)])
    with torch.no_grad():
        logits = target(input_ids=seqs).logits[:, len(PROMPT) - 1:-1]  # [V^3, NEW, V]
    probs = sampling_probs(logits, params)
    tok = seqs[:, len(PROMPT):]
    return probs.gather(-1, tok[..., None])[..., 0].prod(-1).double()  # [V^3]


def sample_counts(target, drafter, params):
    res = speculative_generate(target, DFlashProposer(drafter), [PROMPT] * N, block_size=4,
                               max_new_tokens=NEW, params=params)
    codes = torch.tensor([(t[0] * V + t[1]) * V + t[2] for t in res.tokens])
    return torch.bincount(codes, minlength=V ** NEW).double(), res.metrics


def chi2_pvalue(counts, probs):
    expected = probs * counts.sum()
    big = expected >= 5  # pool the rare outcomes into one bin
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return chisquare(obs[keep].numpy(), exp[keep].numpy() * obs[keep].sum().item()
                     / exp[keep].sum().item()).pvalue


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=12),
])
def test_speculative_sampling_matches_target(small, params):
    target, drafter = small
    counts, metrics = sample_counts(target, drafter, params)
    assert 1.1 < metrics.tau < 3.0  # drafts are partly accepted, partly rejected
    assert chi2_pvalue(counts, exact_distribution(target, params)) > 1e-3


def test_negative_control_is_detected(small, monkeypatch):
    """Accepting every draft samples from the drafter, not the target: the test must see it."""
    def accept_all(draft, q, p, generator=None):
        bonus = torch.multinomial(p[:, -1], 1, generator=generator)[:, 0]
        return torch.full((draft.shape[0],), draft.shape[1]), bonus

    monkeypatch.setattr(gen_mod, "verify_rejection", accept_all)
    target, drafter = small
    params = SamplingParams(temperature=1.0, seed=13)
    counts, _ = sample_counts(target, drafter, params)
    assert chi2_pvalue(counts, exact_distribution(target, params)) < 1e-6
