"""The adaptive-speculation cost model: exact tables for E(q), the block choice and the decayed
survival estimate."""

import pytest

from dflash_plugin.adaptive import Survival, best_block, expected_tokens
from dflash_plugin.errors import ConfigError


@pytest.mark.parametrize("survival,q,want", [
    ([0.9, 0.8, 0.5], 1, 1.0),  # plain decoding commits one token
    ([0.9, 0.8, 0.5], 3, 2.7),
    ([0.9, 0.8, 0.5], 16, 3.2),  # unmeasured positions count as 0
    ([], 8, 1.0),
])
def test_expected_tokens_table(survival, q, want):
    assert expected_tokens(survival, q) == pytest.approx(want)


@pytest.mark.parametrize("round_ms,survival,want", [
    ({1: 1.0, 4: 1.2, 16: 1.6}, [0.9] * 15, 16),  # cheap verify, good drafter: longest
    ({1: 1.0, 4: 1.2, 16: 1.6}, [0.05] + [0.0] * 14, 1),  # drafts rejected: plain decoding
    ({1: 1.0, 4: 2.0, 16: 8.0}, [0.9, 0.8, 0.7] + [0.1] * 12, 4),  # costly long verify: short
    ({1: 1.0, 4: 2.7}, [0.9, 0.5, 0.3], 1),  # E(4) = 2.7 at 2.7 ms ties plain: the shorter
    ({8: 3.0}, [0.0], 8),  # only one option measured
])
def test_best_block_table(round_ms, survival, want):
    assert best_block(round_ms, survival) == want


def test_best_block_bad_input():
    with pytest.raises(ConfigError, match="round_ms"):
        best_block({}, [0.5])
    with pytest.raises(ConfigError, match="round_ms"):
        best_block({0: 1.0, 4: 2.0}, [0.5])
    with pytest.raises(ConfigError, match="round_ms"):
        best_block({1: 0.0}, [0.5])


def test_survival_starts_at_the_prior_and_follows_rounds():
    s = Survival(positions=3, decay=0.5, prior=0.5, prior_rounds=2.0)
    assert s.values() == [0.5, 0.5, 0.5]
    s.observe(drafted=3, accepted=3)  # hits: 0.5*1+1 = 1.5, seen: 2*0.5+1 = 2
    assert s.values() == pytest.approx([0.75, 0.75, 0.75])
    s.observe(drafted=3, accepted=1)  # hits 1.75, 0.75, 0.75 over seen 2
    assert s.values() == pytest.approx([0.875, 0.375, 0.375])
    s.observe(drafted=1, accepted=0)  # only position 1 was drafted
    assert s.values() == pytest.approx([0.875 * 2 * 0.5 / 2, 0.375, 0.375])


def test_survival_is_non_increasing():
    s = Survival(positions=3, decay=1.0, prior=0.0, prior_rounds=0.0001)
    s.observe(drafted=1, accepted=0)
    s.observe(drafted=3, accepted=3)  # position 1: 1/2, positions 2-3: ~1/1
    v = s.values()
    assert v[0] == pytest.approx(0.5, abs=1e-3) and v[1] <= v[0] and v[2] <= v[1]


@pytest.mark.parametrize("kw,field", [({"positions": 0}, "positions"), ({"decay": 0}, "decay"),
                                       ({"prior": 1.5}, "prior")])
def test_survival_bad_input(kw, field):
    with pytest.raises(ConfigError, match=field):
        Survival(**{"positions": 4, **kw})
