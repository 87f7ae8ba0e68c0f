"""Adaptive speculation: exact tables for the cost model (E(q), the block choice, the decayed
survival estimate), the batch policy (pooled rows, probes, config errors), and the policy in the
fast runtime on the bundled code-target pair (fp32, CPU): a policy forced to q = 1 is plain
decoding without a drafter call, switching q mid-request keeps the tokens, round-time
measurement leaves outputs unchanged."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_plugin.adaptive import (
    AdaptiveConfig,
    BlockPolicy,
    Survival,
    best_block,
    expected_tokens,
)
from dflash_plugin.checkpoint import load_drafter
from dflash_plugin.errors import ConfigError
from dflash_plugin.fast import build_decoder, fast_generate
from dflash_plugin.fast import loop as fast_loop
from dflash_plugin.fast.adaptive_loop import measure_round_ms
from dflash_plugin.loading import load_target
from dflash_plugin.training.data import load_prompts_jsonl


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


# ---- the policy (no model) ----

CHEAP = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4}  # launch-bound: verify width nearly free
STEEP = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}  # compute-bound: a round costs q steps


@pytest.mark.parametrize("round_ms,accepted,want", [
    (CHEAP, 15, 16),  # drafts pass, long rounds cheap: the longest
    (STEEP, 15, 1),  # drafts pass, but a round costs as much as q plain steps: plain
    (CHEAP, 0, 1),  # drafts rejected: plain even where rounds are cheap
    ({1: 1.0, 4: 1.5, 16: 6.0}, 3, 4),  # first 3 pass, long verify costly: short
])
def test_policy_picks_speculation_only_where_it_pays(round_ms, accepted, want):
    policy = BlockPolicy(AdaptiveConfig(decay=0.5), round_ms, max_q=16, positions=15)
    for _ in range(6):
        policy.observe_round(15, [accepted] * 4)  # a batch of 4 live rows, one round
    assert policy.choose()[0] == want


def test_policy_pools_rows_and_probes_after_plain_rounds():
    cfg = AdaptiveConfig(reads_every=3, probe_every=5, probe_overhead=0.2)
    costs = {1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0, 16: 3.0}
    policy = BlockPolicy(cfg, costs, max_q=8, positions=15)  # block_size 8 drops q = 16
    assert policy.choose() == (8, 2)  # prior s_k = 0.5: E(8) = 4.5 in 2 ms; read back soon
    assert policy.choose() == (8, 3)  # then reads_every rounds per read
    policy.observe_round(7, [0, 0, 0, 7])  # 4 rows pooled as one round: (0.95 + 1/4) / (1.9 + 1)
    # position 8 (not drafted) keeps its prior 0.5, capped by position 7: non-increasing
    assert policy.survival.values()[:8] == pytest.approx([1.2 / 2.9] * 8)
    for _ in range(10):
        policy.observe_round(7, [0, 0, 0, 0])
    assert policy.choose() == (1, 5)  # plain, for at most probe_every rounds
    for _ in range(5):
        policy.observe_round(0, [0, 0, 0, 0])  # plain rounds: no drafts, the estimate stays
    assert policy.choose() == (8, 1)  # one probe at the longest q: (2 - 1) / 5 <= 0.2
    # a probe costing 1 extra plain round every 5 is over 5 %: probes 20 plain rounds apart
    assert BlockPolicy(AdaptiveConfig(probe_every=5), costs, 8, 15).spacing(1) == 20
    forced = BlockPolicy(AdaptiveConfig(forced=lambda i: [4, 1][i % 2]), {}, 8, 15)
    assert forced.choose() == (4, AdaptiveConfig().reads_every)


def test_a_round_weighs_one_whatever_the_batch():
    """Pooling: a round of 32 rows of which 8 pass weighs as much as a round of 4 rows of which
    1 passes (one round, a quarter past every position), so the prior of 2 rounds means the same
    at every batch size."""
    wide, narrow = Survival(positions=4, decay=0.9), Survival(positions=4, decay=0.9)
    wide.observe_round(4, [4] * 8 + [0] * 24)
    narrow.observe_round(4, [4, 0, 0, 0])
    assert wide.values() == pytest.approx([(0.5 * 2 * 0.9 + 0.25) / (2 * 0.9 + 1)] * 4)
    assert wide.values() == pytest.approx(narrow.values())


def test_probes_at_the_longest_q_undo_a_short_choice():
    """Rounds at q = 8 never verify positions 8-15: early misses there would keep the policy at
    8 for good (censoring). Every `spacing(8)` rounds one round at 16 verifies them again, and
    once they pass the policy goes back to 16."""
    costs = {1: 1.0, 8: 1.2, 16: 1.6}
    policy = BlockPolicy(AdaptiveConfig(probe_every=4), costs, max_q=16, positions=15)
    for _ in range(3):
        policy.observe_round(15, [7])  # position 8 missed three times
    assert policy.choose()[0] == 8
    assert policy.spacing(8) == 7  # a probe costs 1.6 / 1.2 - 1 = 1/3 round: 7 rounds for 5 %
    rounds = []
    for _ in range(30):
        q, most = policy.choose()
        for _ in range(most):
            rounds.append(q)
            policy.observe_round(q - 1, [q - 1])  # now every verified draft passes
    assert rounds[:8] == [8] * 7 + [16] and rounds[-5:] == [16] * 5
    assert policy.spacing(16) == 0 and BlockPolicy(AdaptiveConfig(probe_every=0), costs, 16,
                                                   15).spacing(8) == 0


@pytest.mark.parametrize("kw,field", [
    ({"reads_every": 0}, "reads_every"), ({"probe_every": -1}, "probe_every"),
    ({"probe_overhead": 0}, "probe_overhead"), ({"forced": 0}, "forced"),
    ({"round_ms": {}}, "round_ms"),
    ({"round_ms": {0: 1.0}}, "round_ms"), ({"decay": 0.0}, "decay")])
def test_adaptive_config_bad_input(kw, field):
    with pytest.raises(ConfigError, match=field):
        AdaptiveConfig(**kw)


# ---- in the fast runtime: the bundled code-target pair, fp32 on CPU, no graphs ----

FIX = Path(__file__).resolve().parents[2] / "examples" / "fixtures"
NEW = 16
PICKS = [(5, 24), (1, 31), (4, 40), (11, 45)]  # (dev prompt, tail length): ragged; row 0 accepts


@pytest.fixture(scope="module")
def code_pair():
    target, tok = load_target(str(FIX / "code-target"), "cpu", torch.float32)
    drafter = load_drafter(FIX / "code-target-dflash-b16", "cpu", torch.float32)
    texts = load_prompts_jsonl(FIX / "dev-prompts.jsonl")
    prompts = [tok(texts[i]).input_ids[-n:] for i, n in PICKS]
    return target, drafter, prompts


@pytest.fixture(scope="module")
def runs(code_pair):
    """Decoders of batch 1 and 4 and their plain-decoding outputs (batch 4: ragged prompts and a
    stop token that ends row 0 mid-generation). Plain decoding of this runtime equals HF greedy
    (test_fast.py)."""
    target, drafter, prompts = code_pair
    r = SimpleNamespace(prompts=prompts)
    r.dec1 = build_decoder(target, drafter, batch=1, max_len=128, graphs=False)
    r.dec4 = build_decoder(target, drafter, batch=4, max_len=128, graphs=False)
    r.plain1 = fast_generate(r.dec1, prompts[:1], block_size=1, max_new_tokens=NEW,
                             proposer="ar").tokens
    row = r.plain1[0]
    r.stop = next(t for k, t in enumerate(row) if k >= 6 and t not in row[:k])
    r.plain4 = fast_generate(r.dec4, prompts, block_size=1, max_new_tokens=NEW, proposer="ar",
                             stop_token_ids=(r.stop,)).tokens
    assert r.plain4[0][-1] == r.stop and 6 < len(r.plain4[0]) < NEW
    return r


def test_forced_plain_is_plain_decoding_and_never_drafts(runs, monkeypatch):
    def no_draft(*a, **k):
        raise AssertionError("the drafter was called")
    writes = []
    real_write = fast_loop.context_write

    def write(*a, **k):
        writes.append(1)
        return real_write(*a, **k)
    monkeypatch.setattr(fast_loop, "draft_block", no_draft)
    monkeypatch.setattr(fast_loop, "context_write", write)
    res = fast_generate(runs.dec4, runs.prompts, block_size=16, max_new_tokens=NEW,
                        stop_token_ids=(runs.stop,),
                        adaptive=AdaptiveConfig(forced=1, plain_context=False))
    assert res.tokens == runs.plain4
    assert len(writes) == 1  # the prompt's context (prefill); plain rounds write none
    assert set(res.metrics.block_lengths) == {1} and res.metrics.tau == 1.0
    assert res.metrics.to_dict()["block_lengths"] == {1: max(r.rounds for r in
                                                              res.metrics.requests)}


@pytest.mark.parametrize("batch,plain_context", [(1, True), (4, False)])
def test_switching_block_lengths_mid_request_is_token_identical(runs, batch, plain_context):
    dec, plain = (runs.dec1, runs.plain1) if batch == 1 else (runs.dec4, runs.plain4)
    stops = () if batch == 1 else (runs.stop,)
    seq = [16, 1, 4, 16, 2, 1, 7]
    res = fast_generate(dec, runs.prompts[:batch], block_size=16, max_new_tokens=NEW,
                        stop_token_ids=stops,
                        adaptive=AdaptiveConfig(forced=lambda i: seq[i % len(seq)],
                                                reads_every=2, plain_context=plain_context))
    assert res.tokens == plain
    used = res.metrics.block_lengths
    assert used.get(1) and used.get(16) and len(used) >= 3, used  # it did switch
    assert max(max(r.round_tokens) for r in res.metrics.requests) > 2  # drafts were accepted


def test_measured_policy_after_measurement_is_token_identical(runs):
    """measure_round_ms leaves no trace in outputs; the cost-model policy on the measured times
    gives plain decoding's tokens."""
    dec = runs.dec4
    ms = measure_round_ms(dec, [1, 4], reps=1, rounds=1, context=20)
    assert sorted(ms) == [1, 4] and all(t > 0 for t in ms.values())
    assert dec.round_ms == ms
    try:
        res = fast_generate(dec, runs.prompts, block_size=16, max_new_tokens=NEW,
                            stop_token_ids=(runs.stop,), adaptive=True)
    finally:
        dec.round_ms = {}
    assert res.tokens == runs.plain4
    assert sum(res.metrics.block_lengths.values()) == max(r.rounds for r in res.metrics.requests)


def test_adaptive_bad_input(code_pair, runs):
    target, _, prompts = code_pair
    dec4 = runs.dec4
    plain = build_decoder(target, None, batch=1, max_len=64, graphs=False)
    with pytest.raises(ConfigError, match="adaptive.*drafter"):
        fast_generate(plain, prompts[:1], block_size=8, max_new_tokens=4, proposer="ar",
                      adaptive=True)
    with pytest.raises(ConfigError, match="adaptive"):
        fast_generate(dec4, prompts, block_size=8, max_new_tokens=4, proposer="ngram",
                      adaptive=AdaptiveConfig(forced=2))
    with pytest.raises(ConfigError, match="round_ms.*measure_round_ms"):
        fast_generate(dec4, prompts, block_size=8, max_new_tokens=4, adaptive=True)
    with pytest.raises(ConfigError, match="round_ms.*block_size"):
        fast_generate(dec4, prompts, block_size=4, max_new_tokens=4,
                      adaptive=AdaptiveConfig(round_ms={8: 1.0, 16: 2.0}))
    with pytest.raises(ConfigError, match="forced.*block_size"):
        fast_generate(dec4, prompts, block_size=8, max_new_tokens=4,
                      adaptive=AdaptiveConfig(forced=12))
    for bad in ([], [0, 4], [1, 17], [2.5]):
        with pytest.raises(ConfigError, match="candidates"):
            measure_round_ms(dec4, bad)
    with pytest.raises(ConfigError, match="candidates.*drafter"):
        measure_round_ms(plain, [1, 4])


def test_probes_that_change_nothing_come_further_apart():
    """probe_backoff 2: nothing passes, so each probe leaves the choice at plain and the next
    comes twice as far, up to 4x the base spacing (10 rounds: a probe costs one plain round,
    10 % allowed); once drafts pass the choice moves to the longest q, and back at plain the
    probes start again at the base spacing."""
    costs = {1: 1.0, 16: 2.0}
    cfg = AdaptiveConfig(probe_every=4, probe_overhead=0.1, probe_backoff=2)
    policy = BlockPolicy(cfg, costs, max_q=16, positions=15)
    passing = False

    def serve(n):
        rounds = []
        while len(rounds) < n:
            q, most = policy.choose()
            for _ in range(min(most, n - len(rounds))):
                rounds.append(q)
                policy.observe_round(q - 1, [q - 1 if passing else 0])
        return "".join("x" if q == 16 else "." for q in rounds)

    for _ in range(10):
        policy.observe_round(15, [0])  # nothing passes: plain
    rounds = serve(250)
    probes = [i for i, r in enumerate(rounds) if r == "x"]
    assert [b - a for a, b in zip([-1] + probes, probes)][:5] == [11, 21, 41, 41, 41]
    assert BlockPolicy(AdaptiveConfig(probe_every=4, probe_overhead=0.1), costs, 16,
                       15).spacing(1) == 10  # without backoff: every 10 rounds
    passing = True
    assert serve(100).endswith("x" * 50) and policy.quiet == 0
    passing = False
    rounds = serve(300).lstrip("x")  # the drafts stop passing: back to plain
    assert rounds.startswith("." * 10 + "x" + "." * 20 + "x")  # base spacing again, doubling
