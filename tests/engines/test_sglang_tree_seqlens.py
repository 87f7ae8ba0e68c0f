"""DFLASH_TREE's late host sequence lengths (`sglang_tree_seqlens`): the mirror, its check and
the publish wrapper, on CPU (the CUDA path differs only by the pinned buffer and the event)."""

from types import SimpleNamespace

import pytest
import torch

from dflash_plugin.engines.sglang_tree_seqlens import (
    SeqLensMirror,
    check_against_device,
    give_host_lens,
    late_seq_lens_from_env,
    wrap_publish,
)


def test_mirror_keeps_the_last_length_per_slot():
    m = SeqLensMirror(8, "cpu")
    m.publish(torch.tensor([3, 5]), torch.tensor([100, 40], dtype=torch.int32))  # prefills
    m.publish(torch.tensor([5, 3]), torch.tensor([47, 108]))  # one round, another order
    m.publish(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))  # idle
    assert m.read(torch.tensor([3, 5])).tolist() == [108, 47]
    assert m.read(torch.tensor([5])).tolist() == [47]
    m.publish(torch.tensor([1]), torch.tensor([9]))  # a new request in a freed slot
    assert m.read(torch.tensor([1, 3, 5])).tolist() == [9, 108, 47]


def test_read_is_a_copy():
    m = SeqLensMirror(4, "cpu")
    m.publish(torch.tensor([0]), torch.tensor([7]))
    got = m.read(torch.tensor([0]))
    m.publish(torch.tensor([0]), torch.tensor([11]))
    assert got.tolist() == [7]


def test_give_host_lens_sets_both_fields_and_checks():
    m = SeqLensMirror(4, "cpu")
    m.publish(torch.tensor([2, 0]), torch.tensor([30, 12]))
    batch = SimpleNamespace(req_pool_indices_cpu=torch.tensor([0, 2]),
                            seq_lens=torch.tensor([12, 30]), seq_lens_cpu=None, seq_lens_sum=None)
    give_host_lens(batch, m, check=True)
    assert batch.seq_lens_cpu.tolist() == [12, 30] and batch.seq_lens_sum == 42
    stale = SimpleNamespace(req_pool_indices_cpu=torch.tensor([0, 2]),
                            seq_lens=torch.tensor([12, 33]), seq_lens_cpu=None, seq_lens_sum=None)
    with pytest.raises(RuntimeError, match=r"mirror \[12, 30\] != device \[12, 33\]"):
        give_host_lens(stale, m, check=True)
    give_host_lens(stale, m)  # unchecked: the mirror's values
    assert stale.seq_lens_sum == 42


def test_check_against_device_accepts_other_int_dtypes():
    check_against_device(torch.tensor([5, 6]), torch.tensor([5, 6], dtype=torch.int32))


def test_wrap_publish_calls_sglang_then_records():
    m, seen = SeqLensMirror(4, "cpu"), []
    pub = wrap_publish(seen.append, m, torch.tensor([1, 2]))
    pub(torch.tensor([4, 8]))
    assert [t.tolist() for t in seen] == [[4, 8]]
    assert m.read(torch.tensor([2, 1])).tolist() == [8, 4]
    wrap_publish(None, m, torch.tensor([3]))(torch.tensor([6]))  # no SGLang publish (no overlap)
    assert m.read(torch.tensor([3])).tolist() == [6]


def test_late_seq_lens_from_env(monkeypatch):
    monkeypatch.delenv("DFLASH_TREE_LATE_SEQ_LENS", raising=False)
    monkeypatch.setenv("DFLASH_TREE_LATE_SEQ_LENS_CHECK", "1")
    assert late_seq_lens_from_env() == (False, False)  # off by default; check needs it on
    monkeypatch.setenv("DFLASH_TREE_LATE_SEQ_LENS", "1")
    assert late_seq_lens_from_env() == (True, True)
    monkeypatch.delenv("DFLASH_TREE_LATE_SEQ_LENS_CHECK")
    assert late_seq_lens_from_env() == (True, False)
