"""Do two engines sample the same distribution? Chi-square tests of sampled completions.

Lossless speculative sampling draws every output token from the target's own distribution, so
for one prompt the token at position k (marginalised over everything before it) has the same
distribution with and without speculation. Given S completions of one prompt from each run,
every (prompt, position) gives a 2 x C contingency table of token counts (tokens with fewer
than `min_count` draws in both runs together pooled into one "other" column) and a chi-square
test of homogeneity; the verdict takes the smallest p-value against alpha / (number of tests)
(Bonferroni), so a run passes at family-wise level alpha. A biased sampler (one that favours
the drafter's tokens, or drops the residual's mass) moves these marginals.

The tests assume the two runs are independent draws. Two engines started with the same random
seed and fed the same requests in the same order can replay the same random numbers (SGLang's
plain sampler does: two plain runs of 2,000 completions agreed in order on 1,286 of a prompt's
2,000 against 63 by chance), and correlated runs pass whatever their distributions.
`coincidences` counts completions equal in order against the number independence predicts.
"""

from __future__ import annotations

from collections import Counter


def position_table(a: list[list[int]], b: list[list[int]], k: int,
                   min_count: int = 10) -> list[list[int]]:
    """2 x C counts of the token at position k (0-based) in runs a and b (each a list of token
    lists of one prompt); tokens seen fewer than `min_count` times in a and b together form
    one last column (left out when empty). Completions shorter than k + 1 tokens are skipped."""
    ca = Counter(t[k] for t in a if len(t) > k)
    cb = Counter(t[k] for t in b if len(t) > k)
    both = ca + cb
    kept = sorted(tok for tok, n in both.items() if n >= min_count)
    rows = [[c[tok] for tok in kept] for c in (ca, cb)]
    rest = [sum(c.values()) - sum(r) for c, r in zip((ca, cb), rows)]
    if any(rest):
        rows = [r + [x] for r, x in zip(rows, rest)]
    return rows


def homogeneity_tests(a: dict[str, list[list[int]]], b: dict[str, list[list[int]]],
                      positions: list[int], min_count: int = 10) -> list[dict]:
    """One chi-square test per (prompt, position) over the prompts both runs sampled; a table
    with a single column (one token only, in both runs) has nothing to test: p = 1."""
    from scipy.stats import chi2_contingency

    out = []
    for prompt in sorted(set(a) & set(b)):
        for k in positions:
            table = position_table(a[prompt], b[prompt], k, min_count)
            if len(table[0]) < 2 or not all(sum(r) for r in table):
                out.append({"prompt": prompt, "position": k, "columns": len(table[0]),
                            "chi2": 0.0, "dof": 0, "p": 1.0})
                continue
            res = chi2_contingency(table, correction=False)
            out.append({"prompt": prompt, "position": k, "columns": len(table[0]),
                        "chi2": float(res.statistic), "dof": int(res.dof),
                        "p": float(res.pvalue)})
    return out


def coincidences(a: dict[str, list[list[int]]], b: dict[str, list[list[int]]],
                 alpha: float = 0.01) -> dict:
    """Per prompt: completions equal in order (a[i] == b[i]) against the number expected if the
    runs were independent, sum over completions s of count_a(s) * count_b(s) / n, and the
    Poisson tail P(X >= observed); `independent` is False when a prompt's tail is below
    alpha / (number of prompts)."""
    from scipy.stats import poisson

    rows = []
    for prompt in sorted(set(a) & set(b)):
        xa, xb = [tuple(t) for t in a[prompt]], [tuple(t) for t in b[prompt]]
        n = min(len(xa), len(xb))
        xa, xb = xa[:n], xb[:n]
        ca, cb = Counter(xa), Counter(xb)
        expected = sum(c * cb[s] for s, c in ca.items()) / max(n, 1)
        seen = sum(u == v for u, v in zip(xa, xb))
        rows.append({"prompt": prompt, "equal_in_order": seen, "expected": expected,
                     "p": float(poisson.sf(seen - 1, expected)) if seen else 1.0})
    threshold = alpha / max(len(rows), 1)
    return {"prompts": rows, "threshold": threshold,
            "independent": all(r["p"] >= threshold for r in rows)}


def verdict(tests: list[dict], alpha: float = 0.01) -> dict:
    """Bonferroni over the tests: passes when every p-value is at least alpha / len(tests)."""
    if not tests:
        raise ValueError("no tests: the runs share no prompt")
    worst = min(tests, key=lambda t: t["p"])
    threshold = alpha / len(tests)
    return {"tests": len(tests), "alpha": alpha, "threshold": threshold,
            "min_p": worst["p"], "worst": worst, "passed": worst["p"] >= threshold}


def split_calibration(run: dict[str, list[list[int]]], positions: list[int], splits: int = 100,
                      alpha: float = 0.01, min_count: int = 10, seed: int = 0) -> dict:
    """The tests' false-positive rate on real completions: `splits` random halvings of one
    run's completions (per prompt), each half tested against the other as `verdict` does.
    The halves are independent draws of one distribution, so about alpha of the splits should
    fail, and the median smallest p-value of T uniform tests is about 1 - 0.5 ** (1 / T)."""
    import random
    import statistics

    rng = random.Random(seed)
    mins = []
    for _ in range(splits):
        a, b = {}, {}
        for prompt, done in run.items():
            order = rng.sample(range(len(done)), len(done))
            half = len(done) // 2
            a[prompt] = [done[i] for i in order[:half]]
            b[prompt] = [done[i] for i in order[half:]]
        mins.append(verdict(homogeneity_tests(a, b, positions, min_count), alpha)["min_p"])
    tests = len(run) * len(positions)
    return {"splits": splits, "alpha": alpha, "tests": tests,
            "failed": sum(m < alpha / tests for m in mins),
            "median_min_p": statistics.median(mins),
            "median_min_p_uniform": 1 - 0.5 ** (1 / tests)}
