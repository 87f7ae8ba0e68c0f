"""DFLASH_TREE's tree phase (`sglang_tree_stage.TreeStage`) without SGLang: the same verify
tensors as the eager composition (top-K over an LM head, `build_tree`, `tree_parts`) at several
batch sizes, rounds that reuse a batch size reading that round's inputs, and (gpu-marked) the
same under CUDA-graph replay; the `DFLASH_TREE_GRAPHS` switch."""

import pytest
import torch

from dflash_plugin.engines.sglang_tree_input import tree_parts, with_mask
from dflash_plugin.engines.sglang_tree_stage import ENV, TreeStage, graphs_enabled
from dflash_plugin.engines.sglang_tree_worker import tree_topk
from dflash_plugin.errors import ConfigError
from dflash_plugin.fast.tree_build import build_tree

FIELDS = ("draft_token", "positions", "retrieve_index", "retrieve_next_token",
          "retrieve_next_sibling", "anc")


class Head(torch.nn.Module):  # an LM head's weight is all `tree_topk` reads
    def __init__(self, vocab: int, hidden: int, device):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g).to(device),
                                         requires_grad=False)


def _eager(hidden, bonus, seq_lens, head, k, budget, depth):
    top_lp, top_ids = tree_topk(hidden, head, k)
    tokens, parents, depths = build_tree(top_lp, top_ids, budget)
    return tree_parts(tokens, parents, depths, bonus, seq_lens, depth)


def _round(bs, depth, hidden_size, vocab, seed, device):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(bs, depth + 1, hidden_size, generator=g).to(device)[:, 1:]  # a view
    bonus = torch.randint(0, vocab, (bs,), generator=g).to(device)
    seq_lens = torch.randint(1, 300, (bs,), generator=g).to(device)
    return hidden, bonus, seq_lens


def _check(device, graphs):
    depth, hidden_size, vocab, k, budget = 7, 32, 101, 3, 12
    head = Head(vocab, hidden_size, device)
    stage = TreeStage(device, lambda h: tree_topk(h, head, k), budget, depth, graphs=graphs)
    for seed, bs in enumerate([1, 3, 1, 5, 3, 3]):  # batch sizes come back: replays
        hidden, bonus, seq_lens = _round(bs, depth, hidden_size, vocab, seed, device)
        got = stage.run(hidden, bonus, seq_lens)
        want = _eager(hidden, bonus, seq_lens, head, k, budget, depth)
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(want, f)), (seed, bs, f)
        assert got.custom_mask is None and got.draft_token_num == budget + 1
        total = int(seq_lens.sum())
        assert torch.equal(with_mask(got, seq_lens, total).custom_mask,
                           with_mask(want, seq_lens, total).custom_mask)
    return stage


def test_stage_equals_the_eager_phase_on_cpu():
    stage = _check(torch.device("cpu"), graphs=True)  # off CUDA: eager whatever asked
    assert not stage.graphs.enabled and stage.graphs.graphs == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stage_equals_the_eager_phase_under_cuda_graphs():
    stage = _check(torch.device("cuda"), graphs=True)
    assert stage.graphs.enabled and sorted(stage.graphs.graphs) == [("tree", 1), ("tree", 3),
                                                                    ("tree", 5)]


@pytest.mark.parametrize("raw,on", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_graphs_switch(raw, on):
    assert graphs_enabled({} if raw is None else {ENV: raw}) is on


@pytest.mark.parametrize("raw", ["2", "yes", "off", "-1"])
def test_graphs_switch_refuses_other_values(raw):
    with pytest.raises(ConfigError, match=f"{ENV}: must be 0 or 1.*{raw!r}"):
        graphs_enabled({ENV: raw})
