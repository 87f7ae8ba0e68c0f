"""The fast runtime's "triton" attention backend (specdec_kernels.branch_attention over the static
cache)
against its "sdpa" backend, fp32 on CPU under the interpreter (see conftest.py): `attend` on
ragged visible lengths (per query and per row, split-K too) with stale slots poisoned; verify
logits/features over a ragged batch; greedy `fast_generate` outputs of both backends. On a GPU
the same tests run compiled, on CUDA. Tolerance: fp32 atol = rtol = 1e-5 on CPU, 1e-4 on CUDA
(ieee dots in the kernel; only the summation order differs)."""

import copy
import math

import pytest
import torch

from dflash_plugin.fast import build_decoder, fast_generate
from dflash_plugin.fast.attention import attend, plan
from dflash_plugin.fast.drafter import context_write, draft_block
from dflash_plugin.fast.qwen3 import target_forward
from tests.conftest import fitted_drafter
from tests.kernels._util import CUDA, DEV, direct

pytestmark = direct
pytest.importorskip("specdec_kernels.attention")

TOL = dict(atol=1e-4, rtol=1e-4) if CUDA else dict(atol=1e-5, rtol=1e-5)
PROMPTS = [[5, 17, 29, 41], [9, 8, 7, 6, 5, 4], [11, 12], [20, 30, 40, 50, 60, 70, 80]]


@pytest.mark.parametrize("per_query", [True, False], ids=["causal", "per-row"])
@pytest.mark.parametrize("splits", [1, 3])
def test_attend_matches_sdpa_and_skips_stale_slots(per_query, splits):
    b, h, kvh, s, d, max_len = 3, 4, 2, 5, 16, 48
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, s, h, d, generator=g).to(DEV).transpose(1, 2)  # a view, as in layers
    k = torch.randn(b, kvh, max_len, d, generator=g).to(DEV)
    v = torch.randn(b, kvh, max_len, d, generator=g).to(DEV)
    lengths = torch.tensor([7, 0, 31], device=DEV)  # committed; row 1 sees only its own block
    pos = lengths[:, None] + torch.arange(s, device=DEV)
    visible = pos + 1 if per_query else (lengths + s)[:, None]
    slots = torch.arange(max_len, device=DEV)
    ref = attend(plan("sdpa", visible, slots, h // kvh), q, k, v)
    stale = slots[None, None, :, None] >= visible.amax(-1)[:, None, None, None]
    kp, vp = k.masked_fill(stale, math.nan), v.masked_fill(stale, math.nan)
    got = attend(plan("triton", visible, slots, h // kvh, splits=splits), q, kp, vp)
    torch.testing.assert_close(got, ref, **TOL)


@pytest.fixture(scope="module")
def pair(qwen3_target):
    drafter = fitted_drafter(qwen3_target, num_layers=1, block_size=8)
    return copy.deepcopy(qwen3_target).to(DEV), drafter.to(DEV)


def test_verify_logits_and_drafts_match_sdpa_in_a_ragged_batch(pair):
    """Ragged prefill (padded rows), then verify blocks at different committed lengths with a
    partial commit in between (stale slots behind each row's length), and a drafter block."""
    target, drafter = pair
    layer_ids = drafter.config.target_layer_ids
    decs = {a: build_decoder(target, drafter, batch=3, max_len=40, graphs=False, attention=a)
            for a in ("sdpa", "triton")}
    ids = torch.tensor([[5, 17, 29, 41, 7, 3], [9, 8, 0, 0, 0, 0], [4, 5, 6, 7, 0, 0]], device=DEV)
    pos = torch.arange(6, device=DEV)[None].expand(3, 6)
    for dec in decs.values():
        target_forward(dec.target, dec.tcache, dec.trope, ids, pos, pos + 1, layer_ids)
        dec.tcache.reset(torch.tensor([6, 2, 4], device=DEV))
    gen = torch.Generator().manual_seed(0)
    for keep in ([2, 4, 1], [3, 1, 4]):
        block = torch.randint(4, 97, (3, 4), generator=gen).to(DEV)
        out = {}
        for a, dec in decs.items():
            p = dec.tcache.lengths[:, None] + torch.arange(4, device=DEV)
            hn, feats = target_forward(dec.target, dec.tcache, dec.trope, block, p, p + 1,
                                       layer_ids, a)
            out[a] = (torch.nn.functional.linear(hn, dec.target.lm_head), feats)
            dec.tcache.commit(torch.tensor(keep, device=DEV))
        torch.testing.assert_close(out["triton"], out["sdpa"], **TOL)
    ctx = torch.randn(3, 12, drafter.config.num_context_features, generator=gen).to(DEV)
    ctx_pos = torch.arange(12, device=DEV)[None].expand(3, 12)
    drafts = {}
    for a, dec in decs.items():
        context_write(dec.drafter, dec.dcache, dec.drope, ctx, ctx_pos)
        drafts[a] = draft_block(dec.drafter, dec.dcache, dec.drope, dec.target.embed,
                                dec.target.lm_head, torch.tensor([7, 11, 13], device=DEV), 8, a)
    assert drafts["triton"].tolist() == drafts["sdpa"].tolist()


def test_fast_generate_identical_between_backends(pair):
    """Two ragged rows (the first has long accepts) plus a padding row; ~60 kernel launches."""
    target, drafter = pair
    res = {}
    for a in ("sdpa", "triton"):
        dec = build_decoder(target, drafter, batch=3, max_len=48, graphs=False, attention=a)
        res[a] = fast_generate(dec, PROMPTS[:2], block_size=8, max_new_tokens=16)
    assert res["triton"].tokens == res["sdpa"].tokens
    assert [r.round_tokens for r in res["triton"].metrics.requests] == [
        r.round_tokens for r in res["sdpa"].metrics.requests]
    assert max(res["triton"].metrics.requests[0].round_tokens) > 2  # multi-token commits
