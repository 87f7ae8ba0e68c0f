"""Exact-output tables for the acceptance rules: `verify_greedy`, `verify_rejection` and the fast
runtime's `accept_round` (in the style of vLLM's tests/v1/sample/test_rejection_sampler.py).

Every case builds its logits / distributions by hand so the expected accepted lengths and tokens
are exact. For rejection sampling the distributions make the outcome independent of the uniform
draws: p(x) >= q(x) always keeps x, p(x) = 0 always rejects it, and the residual
normalize(max(p - q, 0)) (or p after a full accept) is one-hot by construction; each case runs
under several seeds.
"""

from __future__ import annotations

import pytest
import torch

from dflash_plugin.fast.accept import MAX_STOPS, accept_round
from dflash_plugin.verify import verify_greedy, verify_rejection

VOCAB = 8


def onehot_logits(rows: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    """[batch, positions, vocab] logits whose argmax at each position is the given id (a clear
    margin over a non-constant background, so argmax is unambiguous)."""
    out = torch.linspace(-1.0, 0.0, vocab).repeat(len(rows), len(rows[0]), 1)
    for b, row in enumerate(rows):
        for i, tok in enumerate(row):
            out[b, i, tok] = 5.0
    return out


def ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), -1)


# ---- verify_greedy --------------------------------------------------------------------------

# (name, draft ids [batch][g], target argmax [batch][g + 1], accepted [batch], bonus [batch])
GREEDY_CASES = [
    ("perfect_match", [[1, 2, 3]], [[1, 2, 3, 4]], [3], [4]),
    ("first_token_miss", [[1, 2, 3]], [[5, 2, 3, 4]], [0], [5]),
    ("miss_in_the_middle", [[1, 2, 3]], [[1, 6, 3, 4]], [1], [6]),
    ("last_draft_miss", [[1, 2, 3]], [[1, 2, 7, 4]], [2], [7]),
    ("match_after_a_miss_is_not_kept", [[1, 2, 3]], [[1, 0, 3, 4]], [1], [0]),
    ("empty_draft", [[]], [[6]], [0], [6]),
    ("single_draft_match", [[2]], [[2, 2]], [1], [2]),
    ("bonus_repeats_a_draft_token", [[3, 3]], [[3, 3, 3]], [2], [3]),
    ("mixed_batch", [[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 4, 4]],
     [[1, 2, 3, 0], [1, 5, 3, 0], [7, 2, 3, 0], [4, 4, 1, 2]], [3, 1, 0, 2], [0, 5, 7, 1]),
]


@pytest.mark.parametrize("name,draft,target,want_acc,want_bonus", GREEDY_CASES,
                         ids=[c[0] for c in GREEDY_CASES])
def test_verify_greedy_table(name, draft, target, want_acc, want_bonus):
    acc, bonus = verify_greedy(ids(draft), onehot_logits(target))
    assert acc.tolist() == want_acc
    assert bonus.tolist() == want_bonus
    assert acc.dtype == bonus.dtype == torch.long


# ---- verify_rejection -----------------------------------------------------------------------

def dist(entries: dict[int, float], vocab: int = VOCAB) -> list[float]:
    out = [0.0] * vocab
    for tok, mass in entries.items():
        out[tok] = mass
    return out


ONE = {0: 1.0}  # placeholder rows that are never reached are still valid distributions

# (name, draft ids [batch][g], q per position (None = deterministic proposer), p per position
#  [batch][g + 1], accepted [batch], bonus [batch])
REJECTION_CASES = [
    ("perfect_match_p_equals_q", [[1, 2]],
     [[{1: 0.7, 5: 0.3}, {2: 0.4, 6: 0.6}]],
     [[{1: 0.7, 5: 0.3}, {2: 0.4, 6: 0.6}, {4: 1.0}]], [2], [4]),
    ("p_above_q_always_keeps", [[1]],
     [[{1: 0.3, 5: 0.7}]], [[{1: 0.9, 5: 0.1}, {3: 1.0}]], [1], [3]),
    ("first_token_miss_residual_one_hot", [[1, 2]],
     [[{1: 0.5, 3: 0.5}, {2: 1.0}]], [[{6: 0.5, 3: 0.5}, {2: 1.0}, {4: 1.0}]], [0], [6]),
    ("miss_at_second_position", [[1, 2]],
     [[{1: 1.0}, {2: 0.6, 7: 0.4}]], [[{1: 1.0}, {5: 0.6, 7: 0.4}, {4: 1.0}]], [1], [5]),
    ("match_after_a_miss_is_not_kept", [[1, 2]],
     [[{1: 1.0}, {2: 1.0}]], [[{3: 1.0}, {2: 1.0}, {4: 1.0}]], [0], [3]),
    ("empty_draft_samples_p", [[]], [[]], [[{5: 1.0}]], [0], [5]),
    ("deterministic_proposer_accept", [[2, 3]], None,
     [[{2: 1.0}, {3: 1.0}, {7: 1.0}]], [2], [7]),
    ("deterministic_proposer_miss", [[2, 3]], None,
     [[{2: 1.0}, {6: 1.0}, {7: 1.0}]], [1], [6]),
    ("mixed_batch", [[1, 2], [1, 2], [1, 2]],
     [[{1: 0.5, 4: 0.5}, {2: 1.0}], [{1: 0.5, 4: 0.5}, {2: 1.0}], [{1: 0.5, 4: 0.5}, {2: 1.0}]],
     [[{1: 0.5, 4: 0.5}, {2: 1.0}, {0: 1.0}],
      [{1: 0.5, 4: 0.5}, {3: 1.0}, ONE],
      [{7: 0.5, 4: 0.5}, {2: 1.0}, ONE]], [2, 1, 0], [0, 3, 7]),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,draft,q,p,want_acc,want_bonus", REJECTION_CASES,
                         ids=[c[0] for c in REJECTION_CASES])
def test_verify_rejection_table(name, draft, q, p, want_acc, want_bonus, seed):
    b, g = len(draft), len(draft[0])
    q_t = None if q is None else torch.tensor(
        [[dist(e) for e in row] for row in q]).reshape(b, g, VOCAB)
    p_t = torch.tensor([[dist(e) for e in row] for row in p])
    gen = torch.Generator().manual_seed(seed)
    acc, bonus = verify_rejection(ids(draft), q_t, p_t, generator=gen)
    assert acc.tolist() == want_acc
    assert bonus.tolist() == want_bonus


# ---- accept_round (fast runtime, greedy, in place) ------------------------------------------

PREFILL_TOKEN, CACHE_LEN, MAX_LEN = 9, 5, 12

# (name, target ids [batch][q], draft ids [batch][q - 1], stop ids, max_new, tokens already out
#  per row (out_len before the round), done before, committed this round [batch], accepted
#  [batch], done after [batch])
ACCEPT_CASES = [
    ("perfect_match_plus_bonus", [[1, 2, 3, 4]], [[1, 2, 3]], [], 10, [1], [False],
     [[1, 2, 3, 4]], [3], [False]),
    ("first_token_miss_commits_the_correction", [[5, 2, 3, 4]], [[1, 2, 3]], [], 10, [1],
     [False], [[5]], [0], [False]),
    ("miss_in_the_middle", [[1, 6, 3, 4]], [[1, 2, 3]], [], 10, [1], [False],
     [[1, 6]], [1], [False]),
    ("block_of_one_no_draft", [[7]], [[]], [], 10, [1], [False], [[7]], [0], [False]),
    ("stop_token_mid_block_cuts_after_it", [[1, 8, 3, 4]], [[1, 8, 3]], [8], 10, [1], [False],
     [[1, 8]], [3], [True]),
    ("stop_as_bonus_token", [[1, 2, 8]], [[1, 2]], [8, 0], 10, [1], [False],
     [[1, 2, 8]], [2], [True]),
    ("stop_after_the_accepted_prefix_is_ignored", [[1, 5, 8, 4]], [[1, 2, 3]], [8], 10, [1],
     [False], [[1, 5]], [1], [False]),
    ("max_new_caps_the_commit", [[1, 2, 3, 4]], [[1, 2, 3]], [], 3, [1], [False],
     [[1, 2]], [3], [True]),
    ("finished_row_commits_nothing", [[1, 2, 3, 4]], [[1, 2, 3]], [], 10, [1], [True],
     [[]], [3], [True]),
    ("mixed_batch", [[1, 2, 3, 4], [1, 6, 3, 4], [5, 2, 3, 4], [1, 8, 3, 4], [1, 2, 3, 4]],
     [[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 8, 3], [1, 2, 3]], [8], 10, [1, 1, 1, 1, 3],
     [False, False, False, False, True],
     [[1, 2, 3, 4], [1, 6], [5], [1, 8], []], [3, 1, 0, 3, 3],
     [False, False, False, True, True]),
]


@pytest.mark.parametrize("name,tgt,drf,stops,max_new,out_len0,done0,want,want_acc,want_done",
                         ACCEPT_CASES, ids=[c[0] for c in ACCEPT_CASES])
def test_accept_round_table(name, tgt, drf, stops, max_new, out_len0, done0, want, want_acc,
                            want_done):
    b = len(tgt)
    stop_t = torch.full((MAX_STOPS,), -1, dtype=torch.long)
    stop_t[:len(stops)] = torch.tensor(stops, dtype=torch.long)
    out_buf = torch.zeros(b, MAX_LEN + 1, dtype=torch.long)
    for r, n0 in enumerate(out_len0):
        out_buf[r, :n0] = PREFILL_TOKEN
    before = out_buf.clone()
    out_len = torch.tensor(out_len0, dtype=torch.long)
    anchor = torch.full((b,), PREFILL_TOKEN, dtype=torch.long)
    lengths = torch.full((b,), CACHE_LEN, dtype=torch.long)
    done = torch.tensor(done0)
    history = torch.zeros(4, 3, b, dtype=torch.long)
    round_idx = torch.zeros(1, dtype=torch.long)
    accept_round(ids(tgt), ids(drf), stop_t, torch.tensor(max_new), out_buf, out_len, anchor,
                 lengths, done, history, round_idx)

    n = [len(w) for w in want]
    assert out_len.tolist() == [a + k for a, k in zip(out_len0, n)]
    for r, w in enumerate(want):
        expect = before[r, :-1].clone()
        expect[out_len0[r]:out_len0[r] + n[r]] = torch.tensor(w, dtype=torch.long)
        assert out_buf[r, :-1].tolist() == expect.tolist()  # nothing else written
    assert anchor.tolist() == [w[-1] if w else PREFILL_TOKEN for w in want]
    assert lengths.tolist() == [CACHE_LEN + k for k in n]
    assert done.tolist() == want_done
    live = [int(not d) for d in done0]
    assert history[0].tolist() == [n, want_acc, live]
    assert history[1:].eq(0).all()
    assert round_idx.tolist() == [int(any(live))]
