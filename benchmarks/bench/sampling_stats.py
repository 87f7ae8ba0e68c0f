"""Do two engines sample the same distribution? Chi-square tests of sampled completions.

Lossless speculative sampling draws every output token from the target's own distribution, so
for one prompt the token at position k (marginalised over everything before it) has the same
distribution with and without speculation. Given S completions of one prompt from each run,
every (prompt, position) gives a 2 x C contingency table of token counts (tokens with fewer
than `min_count` draws in both runs together pooled into one "other" column) and a chi-square
test of homogeneity; the verdict takes the smallest p-value against alpha / (number of tests)
(Bonferroni), so a run passes at family-wise level alpha. A biased sampler (one that favours
the drafter's tokens, or drops the residual's mass) moves these marginals.
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


def verdict(tests: list[dict], alpha: float = 0.01) -> dict:
    """Bonferroni over the tests: passes when every p-value is at least alpha / len(tests)."""
    if not tests:
        raise ValueError("no tests: the runs share no prompt")
    worst = min(tests, key=lambda t: t["p"])
    threshold = alpha / len(tests)
    return {"tests": len(tests), "alpha": alpha, "threshold": threshold,
            "min_p": worst["p"], "worst": worst, "passed": worst["p"] >= threshold}
