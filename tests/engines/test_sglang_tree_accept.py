"""DFLASH_TREE's greedy acceptance in one graph (`sglang_tree_accept`) without SGLang: on random
trees and target choices, the accepted tokens and bonus are `tree.walk_tree`'s; the target-KV
move puts the path's KV at the front of each verify block (a gather-then-scatter pool, as
SGLang's tiled copy kernel behaves); `AcceptStage` writes what the direct calls write at several
batch sizes, after a larger batch left rows in its bucket, and its first replay of a bucket moves
the KV once (a stand-in graph runner that runs a capture's warm-up eagerly, as CUDA's does);
(gpu-marked) the same under real CUDA graphs. SGLang's own kernels on the same inputs:
`sglang_env/checks_tree_accept.py`."""

import pytest
import torch

from dflash_plugin.engines.sglang_tree_accept import Accepted, AcceptStage, accept_round, path_rows
from dflash_plugin.engines.sglang_tree_input import tree_parts
from dflash_plugin.tree import Tree, walk_tree
from tests.engines.test_sglang_tree import random_trees, targets_for

H, SLOTS = 3, 4000


def random_round(bs, g, k, n, seed, device="cpu", follow=0.8):
    """A tree per request, the target's choices (mostly a child's token), slots and hidden."""
    gen = torch.Generator().manual_seed(seed)
    vocab, w = 53, n + 1
    tokens, parents, depths = random_trees(bs, g, k, n, vocab, seed)
    prefix = torch.randint(3, 40, (bs,), generator=gen)
    root = torch.randint(0, vocab, (bs,), generator=gen)
    t = tree_parts(tokens, parents, depths, root, prefix, g)
    choice = targets_for(tokens, parents, vocab, seed + 1, follow)
    loc = 1 + torch.randperm(SLOTS - 1, generator=gen)[:bs * w]  # the verify's out_cache_loc
    hidden = torch.randn(bs * w, H, generator=gen)
    return [x.to(device) for x in (tokens, parents, depths, choice, loc, hidden, prefix)], t


class Pool:
    """Target KV [SLOTS, 2] whose `move` reads every source before writing (SGLang's tiled
    kernel loads a tile's sources, then stores); `moved` lists every pair but slot 0's, off CUDA
    only (listing reads the pairs on the host, which a CUDA graph capture refuses and a replay
    never runs)."""

    def __init__(self, device, seed=0):
        self.kv = torch.randn(SLOTS, 2, generator=torch.Generator().manual_seed(seed)).to(device)
        self.moved = []

    def move(self, tgt, src):
        self.kv[tgt] = self.kv[src].clone()
        if not tgt.is_cuda:
            self.moved += sorted((a, b) for a, b in zip(tgt.tolist(), src.tolist()) if a or b)


class DrafterKV:
    """Stand-in for DFLASH's prefix-valid drafter-KV append (rows < commit at their slots)."""

    def __init__(self, device):
        self.kv = torch.zeros(SLOTS, H + 1, device=device)

    def __call__(self, *, target_hidden, cache_loc, positions, cache_loc_2d, commit_lens):
        bs, d1 = cache_loc_2d.shape
        live = torch.arange(d1, device=commit_lens.device)[None, :] < commit_lens[:, None].long()
        val = torch.cat([target_hidden, positions[:, None].to(target_hidden.dtype)], 1)
        loc = torch.where(live, cache_loc_2d, 0).reshape(-1)  # dead rows -> slot 0 (dummy)
        self.kv.index_copy_(0, loc, torch.where(live.reshape(-1, 1), val, self.kv[loc]))


@pytest.mark.parametrize("bs,g,k,n", [(1, 4, 2, 5), (5, 15, 4, 32), (3, 7, 3, 16)])
def test_accepted_tokens_and_bonus_are_the_walks(bs, g, k, n):
    for trial in range(4):
        (tokens, parents, depths, choice, loc, hidden, prefix), t = random_round(
            bs, g, k, n, seed=trial * 100 + n)
        out = _outputs(choice, t, loc, prefix, g)
        path = _path(choice, t, loc, g)
        assert out.predict.dtype == out.accept_lens.dtype == torch.int32
        for b in range(bs):
            tree = Tree(tokens[b].tolist(), parents[b].tolist(), depths[b].tolist())
            walked, bonus = walk_tree(tree, choice[b].tolist())
            a = int(out.accept_lens[b])
            assert a == len(walked) + 1, (trial, b)
            row = out.predict.view(bs, -1)[b].tolist()
            assert row[:a] == [tree.tokens[i - 1] for i in walked] + [bonus]
            assert int(out.bonus[b]) == bonus and int(out.new_seq_lens[b]) == int(prefix[b]) + a
            assert path[b, :a].tolist() == [0] + walked


def _path(choice, t, loc, g):
    bs = choice.shape[0]
    return accept_round(choice, t.draft_token.view(bs, -1), t.parents, t.depths,
                        loc.view(bs, -1), torch.ones(bs, dtype=torch.bool), g)[1]


def _outputs(choice, t, loc, prefix, g) -> Accepted:
    bs = choice.shape[0]
    predict, _, n, bonus, _, _ = accept_round(choice, t.draft_token.view(bs, -1), t.parents,
                                              t.depths, loc.view(bs, -1),
                                              torch.ones(bs, dtype=torch.bool), g)
    return Accepted(predict.view(-1), n, bonus, prefix + n.to(prefix.dtype))


def test_move_puts_the_path_at_the_front_of_each_block():
    bs, g, k, n = 4, 9, 3, 20
    (_, _, _, choice, loc, _, _), t = random_round(bs, g, k, n, seed=7, follow=0.95)
    w = n + 1
    _, path, n_path, _, tgt, src = accept_round(choice, t.draft_token.view(bs, w), t.parents,
                                                t.depths, loc.view(bs, w),
                                                torch.ones(bs, dtype=torch.bool), g)
    on = torch.arange(g + 1)[None, :] < n_path[:, None]
    pool = Pool("cpu")
    before = pool.kv.clone()
    pool.move(tgt.reshape(-1), src.reshape(-1))
    slots = loc.view(bs, w)
    for b in range(bs):
        a = int(on[b].sum())
        want = before[slots[b, path[b, :a]]]
        assert torch.equal(pool.kv[slots[b, :a]], want), b
    assert torch.equal(pool.kv[0], before[0])  # padding pairs: slot 0 onto itself
    moved = set(slots[on.nonzero(as_tuple=True)[0], on.nonzero(as_tuple=True)[1]].tolist())
    rest = [s for s in range(1, SLOTS) if s not in moved]
    assert torch.equal(pool.kv[rest], before[rest])


def _direct(args, t, g, pool, drafter):
    """The stage's work as plain calls on one batch (no buckets, no graphs)."""
    _, _, _, choice, loc, hidden, prefix = args
    bs, w = choice.shape
    lo = loc.view(bs, w).long()
    predict, path, n, bonus, tgt, src = accept_round(
        choice, t.draft_token.view(bs, w), t.parents, t.depths, lo,
        torch.ones(bs, dtype=torch.bool, device=choice.device), g)
    pool.move(tgt.reshape(-1), src.reshape(-1))
    from dflash_plugin.engines.sglang_tree_append import append_kwargs

    drafter(**append_kwargs(*path_rows(hidden.view(bs, w, -1), lo, path, n, prefix)))
    return Accepted(predict.view(-1), n, bonus, prefix + n.to(prefix.dtype))


class EagerCapture:
    """Stand-in for `StepGraphs` with graphs on: the first run of a key runs its function twice
    (the capture's eager warm-up, then the first replay; CUDA's capture itself runs nothing),
    later runs once."""

    def __init__(self):
        self.enabled, self.graphs, self.captures = True, {}, 0

    def run(self, key, fn, restore=()):
        if key not in self.graphs:
            fn()  # the warm-up
            self.graphs[key] = fn
            self.captures += 1
        fn()  # the replay


def _check_stage(device, graphs, runner=None, sizes=(1, 4, 3, 1, 7, 5, 3, 2), g=6, k=3, n=12,
                 triton=False):
    ours, ref = (Pool(device), DrafterKV(device)), (Pool(device), DrafterKV(device))
    stage = AcceptStage(torch.device(device), ours[0].move, ours[1], n + 1, g, graphs,
                        triton=triton)
    if runner is not None:
        stage.graphs.graphs = runner
    for seed, bs in enumerate(sizes):  # 3 after 4: the bucket's last row is stale
        args, t = random_round(bs, g, k, n, seed=seed, device=device)
        t = type(t)(**{f: (v.to(device) if isinstance(v, torch.Tensor) else v)
                       for f, v in t.__dict__.items()})
        got = stage.run(args[3], t, args[4], args[5], args[6])
        want = _direct(args, t, g, *ref)
        for f in ("predict", "accept_lens", "bonus", "new_seq_lens"):
            assert torch.equal(getattr(got, f), getattr(want, f)), (seed, bs, f)
        assert ours[0].moved == ref[0].moved, (seed, bs)  # each pair once, no stale row's
        # (on CUDA both lists stay empty; the KV below catches a second or a stale move)
        assert torch.equal(ours[0].kv, ref[0].kv), (seed, bs)
        assert torch.equal(ours[1].kv[1:], ref[1].kv[1:]), (seed, bs)
    return stage


def test_stage_does_what_the_direct_calls_do_on_cpu():
    stage = _check_stage("cpu", graphs=True)  # off CUDA: eager whatever asked
    assert not stage.graphs.enabled
    assert stage.warm(8, H, torch.float32) == []


def test_first_replay_of_a_bucket_moves_once():
    """The capture's eager warm-up runs with every row dead: the KV moves once per round."""
    runner = EagerCapture()
    stage = _check_stage("cpu", graphs=True, runner=runner)
    assert runner.captures == 4  # buckets 1, 4, 8 and 2
    assert stage.warm(16, H, torch.float32) == [1, 2, 4, 8, 16]
    assert runner.captures == 5


@pytest.mark.gpu
@pytest.mark.parametrize("triton", [False, True])
def test_stage_under_cuda_graphs(triton):
    """Graphed, with the torch walk or the Triton kernel (DFLASH_TREE_KERNELS=triton): the same
    as the direct torch calls."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    stage = _check_stage("cuda", graphs=True, triton=triton)
    assert stage.graphs.enabled and len(stage.graphs.graphs.graphs) == 4
