"""DFLASH_PREFILL_APPEND (`sglang_prefill_append`) without SGLang: the token buckets, the
switch's values, `PrefillAppend` over a torch reference of DFLASH's append (the flat write of
a prefill against the prefix-valid write of dense rows: the same K/V at the prompt's slots,
nothing at the padded ones, after a longer prompt left stale rows in the buffers), the check
mode's comparison (a stage that writes wrong or nothing fails it); (gpu-marked) the same under
CUDA-graph replay, and `warm` captures every bucket and writes nothing."""

import pytest
import torch

from dflash_plugin.engines.sglang_prefill_append import (
    MAX_TOKENS,
    PrefillAppend,
    append_prompt,
    check_kv,
    mode,
    prefill_buckets,
    token_bucket,
)
from dflash_plugin.errors import ConfigError

SLOTS, H, LAYERS = 3000, 6, 2


class FakeDrafterKV:
    """Stand-in for DFLASH's `_append_target_hidden_to_draft_kv_by_loc` (MOCK: the real one
    needs a drafter and SGLang's KV pool): a projection and a position term per layer, written
    at `cache_loc` (flat, a prefill's) or at rows i < commit_lens[r] of `cache_loc_2d` (dense,
    prefix-valid). Its pool answers `get_key_buffer` / `get_value_buffer` as SGLang's."""

    def __init__(self, device):
        g = torch.Generator().manual_seed(0)
        # small integers: every sum is exact, whatever order a padded matmul's kernel adds in
        self.w = torch.randint(-3, 4, (LAYERS, H, 4), generator=g).float().to(device)
        self.k = torch.zeros(LAYERS, SLOTS, 1, 4, device=device)
        self.v = torch.zeros(LAYERS, SLOTS, 1, 4, device=device)

    def get_key_buffer(self, i):
        return self.k[i]

    def get_value_buffer(self, i):
        return self.v[i]

    def __call__(self, *, target_hidden, cache_loc, positions, cache_loc_2d=None,
                 commit_lens=None):
        loc = cache_loc.long()
        if cache_loc_2d is not None:
            rows, width = cache_loc_2d.shape
            live = (torch.arange(width, device=loc.device)[None, :]
                    < commit_lens[:, None].long()).reshape(-1)
            loc = torch.where(live, cache_loc_2d.reshape(-1).long(), SLOTS - 1)  # dead: a sink
        for i in range(LAYERS):
            val = (target_hidden @ self.w[i] + positions[:, None].to(self.w.dtype))[:, None]
            self.k[i].index_copy_(0, loc, val)
            self.v[i].index_copy_(0, loc, 2 * val)


def _prompt(n, seed, device):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randint(-3, 4, (n, H), generator=g).float().to(device)
    loc = torch.randperm(SLOTS - 1, generator=g)[:n].to(device)
    pos = torch.arange(n, device=device) + int(torch.randint(0, 50, (1,), generator=g))
    return hid, loc, pos


def test_token_buckets_and_the_switch():
    assert [token_bucket(n) for n in (1, 64, 65, 362, 1024, 1025, 1280, 1281)] == [
        64, 64, 128, 384, 1024, 1280, 1280, 1536]
    got = prefill_buckets(MAX_TOKENS)
    assert len(got) == 20 and got[:2] == [64, 128] and got[-3:] == [1536, 1792, 2048]
    assert prefill_buckets(300) == [64, 128, 192, 256, 320]
    with pytest.raises(ValueError, match=">= 1"):
        token_bucket(0)
    assert mode({}) == "1" and mode({"DFLASH_PREFILL_APPEND": "Check"}) == "check"
    assert mode({"DFLASH_PREFILL_APPEND": " "}) == "1"
    assert mode({"DFLASH_PREFILL_APPEND": "0"}) == "0"
    with pytest.raises(ConfigError, match="DFLASH_PREFILL_APPEND: must be 0, 1 or check.*got '2'"):
        mode({"DFLASH_PREFILL_APPEND": "2"})


def _check(device, graphs, sizes=(362, 5, 64, 700, 1500, 65, 1)):
    ours, ref = FakeDrafterKV(device), FakeDrafterKV(device)
    stage = PrefillAppend(device, ours, graphs=graphs)
    assert stage.max_tokens == MAX_TOKENS and not stage.fits(MAX_TOKENS + 1) and stage.fits(1)
    for seed, n in enumerate(sizes):  # a short prompt after a long one: stale buffer rows
        hid, loc, pos = _prompt(n, seed, device)
        stage.run(hid, loc, pos)
        ref(target_hidden=hid, cache_loc=loc, positions=pos)  # DFLASH's flat path
        assert torch.equal(ours.k[:, : SLOTS - 1], ref.k[:, : SLOTS - 1]), (seed, n)
        assert torch.equal(ours.v[:, : SLOTS - 1], ref.v[:, : SLOTS - 1]), (seed, n)
    return stage


def test_stage_writes_what_the_flat_append_writes_on_cpu():
    stage = _check(torch.device("cpu"), graphs=True)  # off CUDA: eager whatever asked
    assert not stage.graphs.enabled and stage.warm(H, torch.float32) == []


def test_check_mode_passes_the_stage_and_fails_a_wrong_or_missing_write():
    device = torch.device("cpu")
    pool = FakeDrafterKV(device)
    hid, loc, pos = _prompt(300, 1, device)
    stage = PrefillAppend(device, pool, graphs=False)
    append_prompt(stage, pool, (pool, range(LAYERS)), target_hidden=hid, cache_loc=loc,
                  positions=pos)
    assert stage.checked == 1 and stage.worst == 0.0

    def off_by_one(**kw):  # positions shifted: RoPE at the wrong place
        pool(**dict(kw, positions=kw["positions"] + 1))
    with pytest.raises(RuntimeError, match="differ from DFLASH's"):
        append_prompt(PrefillAppend(device, off_by_one, graphs=False), pool,
                      (pool, range(LAYERS)), target_hidden=hid, cache_loc=loc, positions=pos)
    with pytest.raises(RuntimeError, match="differ from DFLASH's"):  # writes nothing
        append_prompt(PrefillAppend(device, lambda **kw: None, graphs=False), pool,
                      (pool, range(LAYERS)), target_hidden=hid, cache_loc=loc, positions=pos)
    a = [torch.ones(3, 1, 4, dtype=torch.bfloat16)]
    assert check_kv(a, [a[0] + 0.0078125]) == pytest.approx(0.0078125)  # one bf16 step at 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stage_equals_the_flat_append_under_cuda_graphs_and_warm_writes_nothing():
    device = torch.device("cuda")
    pool = FakeDrafterKV(device)
    stage = PrefillAppend(device, pool)
    assert stage.warm(H, torch.float32) == prefill_buckets(MAX_TOKENS)
    assert torch.count_nonzero(pool.k) == 0 and len(stage.graphs.graphs.graphs) == 20
    stage = _check(device, graphs=True)
    assert stage.graphs.enabled and (384,) in stage.graphs.graphs.graphs
