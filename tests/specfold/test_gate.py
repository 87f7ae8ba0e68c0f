"""SpecFold's plain functions against naive loops: gate, fold-source resolution (chains of
folds on random trees), compaction, attention states and their merge."""

import math
import random

import pytest
import torch

from specfold_plugin.attention import attention_state, merge_states
from specfold_plugin.gate import (
    check_delta,
    check_parents,
    gate,
    gate_vs_source,
    relative_residual,
    resolve_sources,
    source_rows,
)
from spiffy_plugin.errors import ConfigError


def random_tree(rng: random.Random, k: int) -> list[int]:
    return [-1] + [rng.randrange(i) if rng.random() < 0.5 else i - 1 for i in range(1, k)]


def test_gate_matches_naive_loop():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        k, n, d = rng.randint(1, 12), rng.randint(1, 9), rng.choice([3, 16, 64])
        parents = random_tree(rng, k)
        h = torch.randn(k, n, d, generator=gen)
        for i in range(1, k):  # children close to, equal to, or far from their parent
            pick = torch.randint(0, 5, (n,), generator=gen)
            scale = torch.tensor([0.0, 0.03, 0.08, 0.5, 2.0])[pick]
            h[i] = h[parents[i]] + scale[:, None] * torch.randn(n, d, generator=gen)
        if trial == 0 and k > 1:
            h[parents[1], 0] = 0.0  # zero parent row: rho is 0 (equal) or inf
        delta = rng.choice([0.0, 0.05, 0.1, 0.3])
        par = torch.tensor(parents)
        got = gate(h, par, delta)
        rho = relative_residual(h, par)
        for i in range(k):
            for p in range(n):
                if i == 0:
                    assert not got[i, p]
                    continue
                a, b = h[i, p].double(), h[parents[i], p].double()
                diff, base = float((a - b).norm()), float(b.norm())
                want_rho = 0.0 if diff == 0 else (math.inf if base == 0 else diff / base)
                assert rho[i, p].item() == pytest.approx(want_rho, rel=1e-5, abs=1e-7)
                if abs(want_rho - delta) > 1e-5:
                    assert bool(got[i, p]) == (want_rho <= delta), (trial, i, p)


def naive_source(fold, parents, i, p):
    while fold[i][p]:
        i = parents[i]
    return i


@pytest.mark.parametrize("k", [1, 2, 7, 16, 33])
def test_resolve_sources_matches_naive_recursion(k):
    rng = random.Random(k)
    for _ in range(20):
        parents = random_tree(rng, k)
        n = rng.randint(1, 6)
        density = rng.choice([0.3, 0.8, 1.0])
        fold = [[i > 0 and rng.random() < density for _ in range(n)] for i in range(k)]
        got = resolve_sources(torch.tensor(fold), torch.tensor(parents))
        want = [[naive_source(fold, parents, i, p) for p in range(n)] for i in range(k)]
        assert got.tolist() == want
        for i in range(k):
            for p in range(n):
                assert not fold[want[i][p]][p]  # sources are always recomputed


def test_chain_of_folds_resolves_to_the_root():
    k = 9
    parents = [-1] + list(range(k - 1))  # a chain 0 <- 1 <- ... <- 8
    fold = torch.ones(k, 2, dtype=torch.bool)
    fold[0] = False
    fold[4, 1] = False  # position 1 is recomputed at depth 4
    got = resolve_sources(fold, torch.tensor(parents))
    assert got[:, 0].tolist() == [0] * k
    assert got[:, 1].tolist() == [0, 0, 0, 0, 4, 4, 4, 4, 4]


def test_gate_vs_source_measures_against_the_fold_source():
    """Chain 0 <- 1 <- 2 with 0.08 relative steps: the parent rule folds both children (each
    is within 0.1 of its parent), the source rule recomputes branch 2 (0.16 from branch 0, whose
    projections it would reuse); on random trees its sources stay within delta of every row."""
    d = 64
    base = torch.zeros(3, 1, d)
    base[0, 0, 0] = 1.0
    base[1, 0] = base[0, 0]
    base[1, 0, 1] = 0.08
    base[2, 0] = base[1, 0]
    base[2, 0, 1] = 0.16
    par = torch.tensor([-1, 0, 1])
    assert gate(base, par, 0.1)[:, 0].tolist() == [False, True, True]
    assert gate_vs_source(base, par, 0.1)[:, 0].tolist() == [False, True, False]
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    for _ in range(20):
        k, n = rng.randint(1, 10), rng.randint(1, 6)
        parents = random_tree(rng, k)
        h = torch.randn(k, n, 16, generator=gen)
        for i in range(1, k):
            h[i] = h[parents[i]] + 0.04 * torch.randn(n, 16, generator=gen)
        fold = gate_vs_source(h, torch.tensor(parents), 0.1)
        src = resolve_sources(fold, torch.tensor(parents))
        for i in range(1, k):
            for p in range(n):
                s = int(src[i, p])
                rho = float((h[i, p] - h[s, p]).norm() / h[s, p].norm())
                assert rho <= 0.1 + 1e-6 and bool(fold[i, p]) == (s != i)


def test_source_rows_compaction():
    rng = random.Random(1)
    for _ in range(20):
        k, n = rng.randint(1, 8), rng.randint(1, 5)
        parents = random_tree(rng, k)
        fold = torch.tensor([[i > 0 and rng.random() < 0.6 for _ in range(n)] for i in range(k)])
        src = resolve_sources(fold, torch.tensor(parents))
        rows, take = source_rows(src, ~fold)
        assert rows.tolist() == [i * n + p for i in range(k) for p in range(n) if not fold[i, p]]
        for i in range(k):
            for p in range(n):
                assert int(rows[take[i * n + p]]) == int(src[i, p]) * n + p


@pytest.mark.parametrize("heads,kvh,sk_a,sk_b", [(6, 2, 11, 16), (4, 4, 0, 5), (8, 1, 1, 3)])
def test_attention_states_merge_to_full_softmax(heads, kvh, sk_a, sk_b):
    gen = torch.Generator().manual_seed(heads + sk_a)
    b, sq, hd = 3, 7, 16
    q = torch.randn(b, heads, sq, hd, generator=gen)
    ka, va = (torch.randn(b, kvh, sk_a, hd, generator=gen) for _ in range(2))
    kb, vb = (torch.randn(b, kvh, sk_b, hd, generator=gen) for _ in range(2))
    out, m, lsum = merge_states(attention_state(q, ka, va, 0.25), attention_state(q, kb, vb, 0.25))
    k, v = torch.cat([ka, kb], 2), torch.cat([va, vb], 2)
    rep = heads // kvh
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), scale=0.25)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    s = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * 0.25
    torch.testing.assert_close(m + lsum.log(), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("delta", [-0.1, float("nan"), float("inf"), "0.1", True])
def test_bad_delta(delta):
    with pytest.raises(ConfigError, match="delta"):
        check_delta(delta)


@pytest.mark.parametrize("parents", [[], [0], [-1, 1], [-1, 0, 2], [-1, -1]])
def test_bad_parents(parents):
    with pytest.raises(ConfigError, match="parents"):
        check_parents(parents)
