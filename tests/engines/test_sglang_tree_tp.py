"""DFLASH_TREE under tensor parallelism (`sglang_tree_tp`): every rank's tree top-K reads the
whole LM head, reassembled from the vocab-parallel shards (padding rows dropped), so every rank
builds the same tree. CPU, no SGLang: the shards follow SGLang's layout (the vocab padded to a
multiple of 64, split evenly, each rank's real rows first); the layout check against SGLang's own
`VocabParallelEmbedding` is in sglang_env/checks_tp.py."""

from types import SimpleNamespace

import pytest
import torch

from dflash_plugin.engines.sglang_tree_tp import replicated_head, tree_topk, vocab_rows


def sharded(full: torch.Tensor, tp: int, pad: int = 64):
    """The vocab-parallel shards of `full` [V, h] as SGLang lays them out: one head per rank,
    padded rows filled with a large value (they would win every top-K if read)."""
    v, h = full.shape
    per = -(-(-(-v // pad) * pad) // tp)  # padded vocab split evenly
    heads = []
    for r in range(tp):
        start = min(r * per, v)
        count = max(0, min(per, v - start))
        w = torch.full((per, h), 50.0, dtype=full.dtype)
        w[:count] = full[start:start + count]
        heads.append(SimpleNamespace(weight=w, shard_indices=SimpleNamespace(
            org_vocab_start_index=start, num_org_elements=count, num_added_elements=0)))
    return heads


class FakeTPGroup:
    """Stands in for SGLang's `GroupCoordinator` of `len(heads)` ranks (a multi-rank NCCL group
    cannot run on CPU): `all_gather` returns what every rank would contribute, in rank order,
    taken from the ranks' heads (the int64 call: their [start, count]; else: their weights)."""

    def __init__(self, heads):
        self.heads, self.world_size = heads, len(heads)

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        assert dim == 0
        if x.dtype == torch.int64:
            return torch.cat([torch.tensor([int(h.shard_indices.org_vocab_start_index),
                                            int(h.shard_indices.num_org_elements)])
                              for h in self.heads])
        return torch.cat([h.weight for h in self.heads])


@pytest.mark.parametrize("v,tp", [(1000, 2), (1000, 3), (151_936, 2), (130, 4)])
def test_every_rank_reassembles_the_unsharded_head(v, tp):
    full = torch.randn(v, 8, generator=torch.Generator().manual_seed(v + tp))
    heads = sharded(full, tp)
    group = FakeTPGroup(heads)
    for rank in range(tp):
        got = replicated_head(heads[rank], group)
        assert got.shard_indices is None and torch.equal(got.weight, full)


def test_every_rank_drafts_the_tree_of_the_unsharded_head():
    """Top-K log-probs and ids over the reassembled head equal those of one GPU's head on every
    rank: the same tree everywhere, no padding row drafted (a rank's own shard alone would draft
    other ids)."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(1000, 16, generator=gen)
    hidden = torch.randn(3, 5, 16, generator=gen)
    want_lp, want_ids = tree_topk(hidden, SimpleNamespace(weight=full), 4)
    heads = sharded(full, 2)
    for rank in range(2):
        lp, ids = tree_topk(hidden, replicated_head(heads[rank], FakeTPGroup(heads)), 4)
        assert torch.equal(ids, want_ids) and torch.equal(lp, want_lp)
    own_lp, own_ids = tree_topk(hidden, heads[1], 4)  # the shard alone: another distribution
    assert not torch.equal(own_ids, want_ids)


def test_tp1_keeps_the_head_as_it_is():
    head = SimpleNamespace(weight=torch.zeros(4, 2))
    assert replicated_head(head, None) is head
    assert replicated_head(head, SimpleNamespace(world_size=1)) is head


def test_bad_shards_raise_before_any_tree():
    shards = torch.zeros(2, 10, 4)
    with pytest.raises(ValueError, match=r"rank 1 holds ids \[12, 20\) in 10 rows; expected ids "
                                         r"from 10"):
        vocab_rows(shards, [0, 12], [10, 8])
    with pytest.raises(ValueError, match="2 shards but 1 starts"):
        vocab_rows(shards, [0], [10])
    head = SimpleNamespace(weight=torch.zeros(4, 2))  # no shard indices under TP
    with pytest.raises(ValueError, match="no shard indices"):
        replicated_head(head, SimpleNamespace(world_size=2))
    lora = SimpleNamespace(weight=torch.zeros(4, 2), shard_indices=SimpleNamespace(
        org_vocab_start_index=0, num_org_elements=4, num_added_elements=2))
    with pytest.raises(ValueError, match="added"):
        replicated_head(lora, SimpleNamespace(world_size=2))
