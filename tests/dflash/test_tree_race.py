"""DFLASH_TREE's fast acceptance at T > 0 is lossless in distribution (CPU, no engine).

`specdec_kernels.sampling.race_sample` draws one token per row of softmax(logits / T); the tree
walk (`specdec_kernels.reference.tree_accept`, what `AcceptStage` replays) follows the child
that carries the sample at every node. We enumerate every outcome of one small tree (the
accepted path's tokens, then the bonus) with its exact probability under the target, and run a
chi-square test on many rounds of that tree drawn as one batch. Negative controls: the wrong
temperature, and a walk that prefers the drafter's first child, must both fail the same test.
"""

import pytest
import torch
from scipy.stats import chisquare
from specdec_kernels import reference, sampling
from specdec_kernels.sampling import race_sample

from dflash_plugin.engines.sglang_tree_input import build_verify_tensors
from dflash_plugin.fast.tree_build import build_tree

V, G, K, NODES = 6, 3, 2, 7  # vocabulary, depths, top-K, node budget
ROUNDS = 60000


def pvalue(counts: dict, probs: dict) -> float:
    """Chi-square goodness of fit, outcomes expected below 5 times pooled into one bin."""
    n = sum(counts.values())
    big = [o for o, p in probs.items() if p * n >= 5]
    obs = [counts.get(o, 0) for o in big] + [n - sum(counts.get(o, 0) for o in big)]
    exp = [probs[o] * n for o in big] + [n * (1 - sum(probs[o] for o in big))]
    keep = [i for i, e in enumerate(exp) if e > 0]
    assert sum(counts.get(o, 0) for o in counts if o not in probs) == 0, "impossible outcome"
    obs, exp = [obs[i] for i in keep], [exp[i] for i in keep]
    return chisquare(obs, [e * n / sum(exp) for e in exp]).pvalue


@pytest.mark.parametrize("temp", [1.0, 0.6])
def test_race_sample_draws_softmax_over_t(temp):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=gen) * 2  # [3, V]
    rows = logits[:, None].expand(3, 20000, V)
    picks = race_sample(rows, torch.tensor(temp).view(1, 1, 1), generator=gen)  # [3, n]
    for r in range(3):
        probs = torch.softmax(logits[r] / temp, -1).tolist()
        counts = torch.bincount(picks[r], minlength=V).tolist()
        assert pvalue(dict(enumerate(counts)), dict(enumerate(probs))) > 1e-3
        wrong = torch.softmax(logits[r] / (2 * temp), -1).tolist()  # control: T doubled
        assert pvalue(dict(enumerate(counts)), dict(enumerate(wrong))) < 1e-6


def test_race_sample_greedy_rows_chunks_and_per_row_temperature(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 5, 50, generator=gen)
    greedy = torch.tensor([True, False, True, False]).view(4, 1)
    temp = torch.tensor([1.0, 1e-4, 1.0, 1e-4]).view(4, 1, 1)  # tiny T: the argmax as well
    monkeypatch.setattr(sampling, "RACE_CHUNK", 120)  # 2 rows of 50 per chunk: 10 chunks
    out = race_sample(logits, temp, greedy, generator=gen)
    assert out.shape == (4, 5) and out.dtype == torch.long
    assert torch.equal(out, logits.argmax(-1))
    hot = race_sample(logits, torch.full((4, 1, 1), 50.0), greedy, generator=gen)
    assert torch.equal(hot[greedy[:, 0]], logits.argmax(-1)[greedy[:, 0]])
    assert not torch.equal(hot[~greedy[:, 0]], logits.argmax(-1)[~greedy[:, 0]])


def _tree():
    gen = torch.Generator().manual_seed(7)
    top_lp, top_ids = torch.randn(1, G, V, generator=gen).log_softmax(-1).topk(K, -1)
    tokens, parents, depths = build_tree(top_lp, top_ids, NODES)
    seq = torch.tensor([9])
    t = build_verify_tensors(tokens, parents, depths, torch.tensor([1]), seq, 9, G)
    logits = torch.randn(NODES + 1, V, generator=gen)  # the target at every tree index
    draft, parents = t.draft_token.view(-1), t.parents[0]
    for i in range(1, NODES + 1):  # a target that often agrees with the drafter
        logits[parents[i], draft[i]] += 1.5
    return t, logits


def exact_outcomes(t, logits, temp: float) -> dict:
    """(path tokens..., bonus) -> probability: at each node the target's sample either is a
    child's token (move there) or ends the round as the bonus."""
    draft, parents = t.draft_token.view(-1).tolist(), t.parents[0].tolist()
    kids = {}
    for i in range(1, len(parents)):
        kids.setdefault(parents[i], {})[draft[i]] = i
    probs = torch.softmax(logits.double() / temp, -1)
    out = {}

    def walk(node, seq, p):
        for tok in range(V):
            q = p * float(probs[node, tok])
            child = kids.get(node, {}).get(tok)
            if child is None:
                out[seq + (tok,)] = q
            else:
                walk(child, seq + (tok,), q)

    walk(0, (), 1.0)
    assert abs(sum(out.values()) - 1) < 1e-9 and max(len(s) for s in out) > 2
    return out


def sampled_outcomes(t, logits, temp: float, prefer_first_child: bool = False) -> dict:
    w = NODES + 1
    rep = lambda x: x.view(1, w).expand(ROUNDS, w)  # noqa: E731 the same tree every round
    gen = torch.Generator().manual_seed(11)
    choice = race_sample(logits.expand(ROUNDS, w, V), torch.tensor(temp).view(1, 1, 1),
                         generator=gen)  # [rounds, W]
    if prefer_first_child:  # control: a biased walk takes the drafter's first child half the time
        first = {}
        for i in range(1, w):
            first.setdefault(int(t.parents[0, i]), int(t.draft_token.view(-1)[i]))
        coin = torch.rand(ROUNDS, generator=gen) < 0.5
        for node, tok in first.items():
            choice[coin, node] = tok
    loc = torch.arange(w).expand(ROUNDS, w)
    predict, _, n, _, _, _ = reference.tree_accept(
        choice, rep(t.draft_token), rep(t.parents), rep(t.depths), loc,
        torch.ones(ROUNDS, dtype=torch.bool), G)
    counts = {}
    for row, k in zip(predict.tolist(), n.tolist()):
        key = tuple(row[:k])  # the scheduler's tokens: the path's, then the bonus
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_walk_by_sampled_tokens_emits_the_targets_distribution(temp):
    t, logits = _tree()
    exact = exact_outcomes(t, logits, temp)
    counts = sampled_outcomes(t, logits, temp)
    assert sum(c for s, c in counts.items() if len(s) > 1) > ROUNDS // 10  # drafts accepted
    assert pvalue(counts, exact) > 1e-3
    assert pvalue(sampled_outcomes(t, logits, temp, prefer_first_child=True), exact) < 1e-6


@pytest.mark.gpu
def test_race_sample_in_a_cuda_graph_draws_fresh_samples():
    """Replays of one captured draw give new samples with the right distribution (torch's
    CUDA generator advances its offset per replay)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3)).cuda()
    temp = torch.full((1, 1), 0.8, device="cuda")
    race_sample(logits, temp)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = race_sample(logits, temp)
    picks = []
    for _ in range(5000):
        graph.replay()
        picks.append(out.clone())
    counts = torch.bincount(torch.cat(picks).cpu(), minlength=V).tolist()
    probs = torch.softmax(logits[0].cpu() / 0.8, -1).tolist()
    assert pvalue(dict(enumerate(counts)), dict(enumerate(probs))) > 1e-3
