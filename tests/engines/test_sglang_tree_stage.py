"""DFLASH_TREE's tree phase (`sglang_tree_stage.TreeStage`) without SGLang: the same verify
tensors as the eager composition (top-K over an LM head, `build_tree`, `tree_parts`) at several
batch sizes, rounds that reuse a batch size reading that round's inputs, and (gpu-marked) the
same under CUDA-graph replay (one graph per bucket of batch sizes, all captured by `warm`); the
buckets; padded rows left from a larger batch; the `DFLASH_TREE_GRAPHS` and `DFLASH_TREE_KERNELS`
switches (gpu-marked: the fused build kernel under graphs)."""

import pytest
import torch

from dflash_plugin.engines.sglang_buckets import (
    ENV,
    WARM_MAX_BS,
    bucket,
    graphs_enabled,
    warm_buckets,
)
from dflash_plugin.engines.sglang_tree_input import tree_parts, with_mask
from dflash_plugin.engines.sglang_tree_stage import KERNELS_ENV, TreeStage, triton_kernels_from_env
from dflash_plugin.engines.sglang_tree_tp import tree_topk
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


def _check(device, graphs, triton_build=False):
    depth, hidden_size, vocab, k, budget = 7, 32, 101, 3, 12
    head = Head(vocab, hidden_size, device)
    stage = TreeStage(device, lambda h: tree_topk(h, head, k), budget, depth, graphs=graphs,
                      triton_build=triton_build)
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
    assert not stage.graphs.enabled and stage.graphs.graphs.graphs == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stage_equals_the_eager_phase_under_cuda_graphs():
    stage = _check(torch.device("cuda"), graphs=True)
    assert stage.graphs.enabled and sorted(stage.graphs.graphs.graphs) == [(1,), (4,), (8,)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stage_with_the_fused_build_kernel_under_cuda_graphs():
    """DFLASH_TREE_KERNELS=triton: the same tensors as the eager torch phase, graphed."""
    stage = _check(torch.device("cuda"), graphs=True, triton_build=True)
    assert stage.graphs.enabled and sorted(stage.graphs.graphs.graphs) == [(1,), (4,), (8,)]


@pytest.mark.parametrize("raw,on", [(None, False), ("torch", False), ("triton", True),
                                    (" Triton ", True)])
def test_build_switch(raw, on):
    env = {} if raw is None else {KERNELS_ENV: raw}
    assert triton_kernels_from_env(torch.device("cuda"), env) is on
    assert triton_kernels_from_env(torch.device("cpu"), env) is False  # CUDA only
    with pytest.raises(ConfigError, match=f"{KERNELS_ENV}: must be torch or triton"):
        triton_kernels_from_env(torch.device("cuda"), {KERNELS_ENV: "cuda"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warm_captures_every_bucket_and_rounds_capture_no_more():
    device = torch.device("cuda")
    depth, hidden_size, vocab, k, budget = 7, 32, 101, 3, 12
    head = Head(vocab, hidden_size, device)
    stage = TreeStage(device, lambda h: tree_topk(h, head, k), budget, depth)
    assert stage.warm(11, hidden_size, torch.float32) == [1, 2, 4, 8, 16]
    graphs = dict(stage.graphs.graphs.graphs)
    for seed, bs in enumerate(range(1, 12)):
        hidden, bonus, seq_lens = _round(bs, depth, hidden_size, vocab, seed, device)
        got = stage.run(hidden, bonus, seq_lens)
        want = _eager(hidden, bonus, seq_lens, head, k, budget, depth)
        assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in FIELDS), bs
    assert stage.graphs.graphs.graphs == graphs  # the same graph objects: nothing captured again


@pytest.mark.parametrize("bs,want", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (16, 16),
                                     (17, 24), (33, 40)])
def test_buckets(bs, want):
    assert bucket(bs) == want


def test_start_up_captures_stop_at_a_cap():
    """A server with thousands of running requests captures 35 buckets at start-up, not 515."""
    assert warm_buckets(11) == [1, 2, 4, 8, 16]
    assert warm_buckets(4096) == warm_buckets(WARM_MAX_BS)
    assert len(warm_buckets(4096)) == 3 + WARM_MAX_BS // 8 == 35


def test_bucket_refuses_empty_batches():
    with pytest.raises(ValueError, match="batch size must be >= 1, got 0"):
        bucket(0)


def test_padded_rows_do_not_leak_into_a_smaller_batch_on_cpu():
    """A batch of 3 after one of 4 in the same bucket: row 4 holds the old round's inputs, the
    outputs are cut to 3 rows and equal the eager phase of those 3 alone; warm is a no-op
    without CUDA."""
    device = torch.device("cpu")
    depth, hidden_size, vocab, k, budget = 5, 16, 53, 2, 9
    head = Head(vocab, hidden_size, device)
    stage = TreeStage(device, lambda h: tree_topk(h, head, k), budget, depth)
    assert stage.warm(8, hidden_size, torch.float32) == []
    stage.run(*_round(4, depth, hidden_size, vocab, 1, device))
    hidden, bonus, seq_lens = _round(3, depth, hidden_size, vocab, 2, device)
    got = stage.run(hidden, bonus, seq_lens)
    want = _eager(hidden, bonus, seq_lens, head, k, budget, depth)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert got.draft_token.shape == (3 * (budget + 1),) and got.anc.shape[0] == 3


@pytest.mark.parametrize("raw,on", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_graphs_switch(raw, on):
    assert graphs_enabled({} if raw is None else {ENV: raw}) is on


@pytest.mark.parametrize("raw", ["2", "yes", "off", "-1"])
def test_graphs_switch_refuses_other_values(raw):
    with pytest.raises(ConfigError, match=f"{ENV}: must be 0 or 1.*{raw!r}"):
        graphs_enabled({ENV: raw})


def test_reserved_buckets_share_one_set_of_input_buffers():
    """After `reserve(rows)` every bucket up to rows loads into views of the same buffers (the
    start-up captures no longer hold one buffer per bucket); a larger or differently shaped
    input gets buffers of its own, and each bucket's rows hold that load's inputs."""
    from dflash_plugin.engines.sglang_buckets import BucketGraphs

    g = BucketGraphs(torch.device("cpu"), "test")
    g.reserve(16)
    ptrs = set()
    for bs in (1, 3, 9, 16, 2):
        x = torch.arange(bs * 4, dtype=torch.float32).view(bs, 4) + bs
        pad, (buf,) = g.load((x,))
        assert pad == bucket(bs) and buf.shape == (pad, 4) and torch.equal(buf[:bs], x)
        ptrs.add(buf.data_ptr())
    assert len(ptrs) == 1
    pad, (big,) = g.load((torch.zeros(17, 4),))  # past the reservation
    assert pad == 24 and big.data_ptr() not in ptrs
    pad, (other,) = g.load((torch.zeros(2, 5),))  # another shape: new buffers
    assert other.shape == (2, 5) and other.data_ptr() not in ptrs
    unreserved = BucketGraphs(torch.device("cpu"), "test")
    a = unreserved.load((torch.zeros(1, 4),))[1][0]
    b = unreserved.load((torch.zeros(3, 4),))[1][0]
    assert a.shape == (1, 4) and b.shape == (4, 4) and a.data_ptr() != b.data_ptr()
