"""DFLASH_TREE's drafter-KV append (`sglang_tree_append`) without SGLang: `AppendStage` over a
torch reference of DFLASH's prefix-valid write (a projection, a position term, rows < commit
written at their slots) writes what the direct call writes, at several batch sizes and after a
larger batch left rows in the bucket; `accepted_path` picks the front rows of each verify block;
`warm_for` reads a worker's running-request limit and drafter `fc`; (gpu-marked) the same under
CUDA-graph replay, `warm` captures every bucket, and a workspace the append function replaces
after capture stays valid through `keep`."""

import pytest
import torch

from dflash_plugin.engines.sglang_buckets import bucket as stage_bucket
from dflash_plugin.engines.sglang_tree_append import AppendStage, accepted_path, append_kwargs

SLOTS, H, DEPTH1 = 400, 6, 5


class FakeDrafterKV:
    """Stand-in for DFLASH's `_append_target_hidden_to_draft_kv_by_loc`: the same keywords,
    a projection into a workspace, then rows i < commit_lens[b] of request b written at
    cache_loc_2d[b, i] (SGLang's prefix-valid write)."""

    def __init__(self, device):
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(H, 4, generator=g).to(device)
        self.kv = torch.zeros(SLOTS, 4, device=device)
        self.ws = torch.empty(64 * DEPTH1, 4, device=device)  # a workspace, like the helper's

    def __call__(self, *, target_hidden, cache_loc, positions, cache_loc_2d, commit_lens):
        n = target_hidden.shape[0]
        torch.mm(target_hidden, self.w, out=self.ws[:n])
        val = self.ws[:n] + positions[:, None].to(self.ws.dtype)  # [n, 4]
        bs, d1 = cache_loc_2d.shape
        live = torch.arange(d1, device=commit_lens.device)[None, :] < commit_lens[:, None].long()
        loc = torch.where(live, cache_loc_2d, SLOTS - 1).reshape(-1)  # dead rows -> a sink slot
        self.kv.index_copy_(0, loc, torch.where(live.reshape(-1, 1), val, self.kv[loc]))

    def workspaces(self):
        return [self.ws]


def _round(bs, seed, device):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(bs, DEPTH1 + 2, H, generator=g).to(device)[:, :DEPTH1]  # a view
    loc = (torch.randperm(SLOTS - 1, generator=g)[: bs * DEPTH1].view(bs, DEPTH1)).to(device)
    pos = torch.randint(0, 500, (bs, 1), generator=g).to(device) + torch.arange(DEPTH1,
                                                                               device=device)
    commit = torch.randint(1, DEPTH1 + 1, (bs,), generator=g).to(torch.int32).to(device)
    return hid, loc, pos, commit


def _check(device, graphs, sizes=(1, 4, 3, 1, 7, 5, 3, 2)):
    ours, ref = FakeDrafterKV(device), FakeDrafterKV(device)
    stage = AppendStage(device, ours, graphs, keep=ours.workspaces)
    for seed, bs in enumerate(sizes):  # batch sizes come back: replays; 3 after 4: stale rows
        args = _round(bs, seed, device)
        stage.run(*args)
        ref(**append_kwargs(*args))
        assert torch.equal(ours.kv[: SLOTS - 1], ref.kv[: SLOTS - 1]), (seed, bs)
        commit = stage.graphs.inputs[stage_bucket(bs)][3]
        assert torch.equal(commit[:bs], args[3]) and not commit[bs:].any()  # stale rows: 0
    return stage, ours


def test_stage_writes_what_the_direct_call_writes_on_cpu():
    stage, _ = _check(torch.device("cpu"), graphs=True)  # off CUDA: eager whatever asked
    assert not stage.graphs.enabled and stage.graphs.held == []
    assert stage.warm(8, DEPTH1, H, torch.float32) == []


def test_accepted_path_takes_the_front_rows_of_each_verify_block():
    bs, w, d1 = 2, 7, 4
    hidden = torch.arange(bs * w, dtype=torch.float32)[:, None].repeat(1, 3)  # row id
    slots = 100 + torch.arange(bs * w)
    prefix = torch.tensor([10, 20])
    hid, loc, pos, commit = accepted_path(hidden, slots, prefix, torch.tensor([2, 4]), w, d1)
    assert hid.shape == (bs, d1, 3) and hid[1, :, 0].tolist() == [7, 8, 9, 10]
    assert loc.dtype == pos.dtype == torch.int64 and commit.dtype == torch.int32
    assert loc.tolist() == [[100, 101, 102, 103], [107, 108, 109, 110]]
    assert pos.tolist() == [[10, 11, 12, 13], [20, 21, 22, 23]]
    kw = append_kwargs(hid, loc, pos, commit)
    assert kw["target_hidden"].shape == (bs * d1, 3) and kw["cache_loc"].shape == (bs * d1,)
    assert kw["cache_loc_2d"] is loc and kw["commit_lens"] is commit


def test_warm_for_takes_the_workers_limit_and_drafter_width():
    """DFLASH_TREE and DFLASH_ADAPTIVE capture through `warm_for`: the limit from
    max_running_requests (else cuda_graph_max_bs_decode), the hidden width and dtype of the
    drafter's fc; nothing without a limit or an fc."""
    from types import SimpleNamespace

    stage = AppendStage(torch.device("cpu"), FakeDrafterKV("cpu"), graphs=False)
    calls = []
    stage.warm = lambda *a: calls.append(a) or [1]
    fc = torch.nn.Linear(12, 4).to(torch.bfloat16)

    def worker(**args):
        return SimpleNamespace(server_args=SimpleNamespace(**args),
                               draft_model=SimpleNamespace(fc=fc))

    assert stage.warm_for(worker(max_running_requests=24), 3) == [1]
    assert stage.warm_for(worker(max_running_requests=None, cuda_graph_max_bs_decode=8), 1)
    assert calls == [(24, 3, 12, torch.bfloat16), (8, 1, 12, torch.bfloat16)]
    assert stage.warm_for(worker(max_running_requests=None), 3) == []
    no_fc = SimpleNamespace(server_args=SimpleNamespace(max_running_requests=4),
                            draft_model=SimpleNamespace())
    assert stage.warm_for(no_fc, 3) == [] and len(calls) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stage_equals_the_direct_call_under_cuda_graphs():
    stage, ours = _check(torch.device("cuda"), graphs=True)
    assert stage.graphs.enabled and sorted(stage.graphs.graphs.graphs) == [(1,), (2,), (4,),
                                                                           (8,)]
    assert stage.graphs.held == [ours.ws]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warm_writes_nothing_and_a_replaced_workspace_stays_valid():
    device = torch.device("cuda")
    ours, ref = FakeDrafterKV(device), FakeDrafterKV(device)
    stage = AppendStage(device, ours, keep=ours.workspaces)
    assert stage.warm(11, DEPTH1, H, torch.float32) == [1, 2, 4, 8, 16]
    assert torch.count_nonzero(ours.kv) == 0  # commit 0 everywhere
    graphs = dict(stage.graphs.graphs.graphs)
    ours.ws = torch.empty(4096, 4, device=device)  # the engine grows its workspace (prefill)
    junk = [torch.full((64 * DEPTH1, 4), 7.0, device=device) for _ in range(8)]  # reuse bait
    for seed, bs in enumerate(range(1, 12)):
        args = _round(bs, seed, device)
        stage.run(*args)
        ref(**append_kwargs(*args))
        assert torch.equal(ours.kv[: SLOTS - 1], ref.kv[: SLOTS - 1]), bs
    assert stage.graphs.graphs.graphs == graphs and all(float(j[0, 0]) == 7.0 for j in junk)
