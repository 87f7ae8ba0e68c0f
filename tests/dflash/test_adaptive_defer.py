"""`engines.sglang_adaptive_defer.DeferredAppend` (torch only, no engine): the q = 1 steps'
drafter-context rows held in arrival order, handed back together, capacity and shape checks,
and the environment switch's errors."""

import pytest
import torch

from dflash_plugin.engines.sglang_adaptive_defer import ENV, DeferredAppend, capacity_from_env


def test_rows_come_back_in_arrival_order_and_the_buffer_empties():
    held = DeferredAppend(5)
    assert held.take() is None
    h = torch.arange(12, dtype=torch.float32).view(6, 2)
    held.add(h[:2], torch.tensor([[7], [3]]), torch.tensor([10, 11]))  # [bs, 1] slots
    held.add(h[2:5], torch.tensor([9, 4, 8]), torch.tensor([[12], [13], [14]]))
    assert held.n == 5 and not held.fits(1)
    hidden, loc, pos = held.take()
    assert torch.equal(hidden, h[:5])
    assert loc.tolist() == [7, 3, 9, 4, 8] and pos.tolist() == [10, 11, 12, 13, 14]
    assert loc.dtype == pos.dtype == torch.int64
    assert held.n == 0 and held.fits(5) and held.take() is None
    held.add(h[5:], torch.tensor([1]), torch.tensor([15]))  # the buffers are reused
    hidden, loc, _ = held.take()
    assert torch.equal(hidden, h[5:]) and loc.tolist() == [1]


def test_what_does_not_fit_or_match_is_refused():
    held = DeferredAppend(2)
    with pytest.raises(ValueError, match="do not fit"):
        held.add(torch.zeros(3, 4), torch.zeros(3), torch.zeros(3))
    held.add(torch.zeros(1, 4), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="another width"):
        held.add(torch.zeros(1, 8), torch.zeros(1), torch.zeros(1))
    held.take()
    held.add(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1), torch.zeros(1))
    assert held.hidden.shape == (2, 8) and held.hidden.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="capacity"):
        DeferredAppend(0)


@pytest.mark.parametrize("raw, want", [(None, 1024), ("", 1024), ("0", 0), ("1024", 1024),
                                       ("64", 64)])
def test_capacity_from_env(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, raw)
    assert capacity_from_env() == want


@pytest.mark.parametrize("raw, message", [("-1", ">= 0"), ("many", "integer")])
def test_capacity_from_env_errors_name_the_variable(monkeypatch, raw, message):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ValueError, match=f"{ENV}.*{message}"):
        capacity_from_env()
