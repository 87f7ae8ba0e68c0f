"""The fast runtime's "triton-invariant" attention plan: a query's output is bitwise the same
whether it is the one query of a decode step or one of the 16 queries of a verify block (split
count, split spans and query tile fixed by the cache size), and it matches SDPA (fp32, atol =
rtol = 1e-5 on CPU, 1e-4 on CUDA). Also: the kernel's `split_tokens` argument is checked."""

import pytest
import torch

from dflash_plugin.fast.attention import attend, invariant_splits, plan
from tests.kernels._util import CUDA, DEV, direct

pytestmark = direct
ka = pytest.importorskip("specdec_kernels.attention")

TOL = dict(atol=1e-4, rtol=1e-4) if CUDA else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_and_verify_give_each_query_the_same_bits(dtype):
    b, h, kvh, q, d, max_len = 2, 6, 2, 16, 16, 576  # 2 splits of 288 slots on CPU
    assert invariant_splits(max_len, torch.device(DEV))[0] > 1
    g = torch.Generator().manual_seed(3)
    k = torch.randn(b, kvh, max_len, d, generator=g).to(DEV, dtype)
    v = torch.randn(b, kvh, max_len, d, generator=g).to(DEV, dtype)
    qs = torch.randn(b, q, h, d, generator=g).to(DEV, dtype)
    lengths = torch.tensor([270, 300], device=DEV)  # the block straddles the split boundary
    slots = torch.arange(max_len, device=DEV)
    pos = lengths[:, None] + torch.arange(q, device=DEV)
    verify = attend(plan("triton-invariant", pos + 1, slots, h // kvh), qs.transpose(1, 2), k, v)
    ref = attend(plan("sdpa", pos + 1, slots, h // kvh), qs.float().transpose(1, 2), k.float(),
                 v.float())
    torch.testing.assert_close(verify.float(), ref, **(TOL if dtype == torch.float32 else
                                                       dict(atol=2e-2, rtol=2e-2)))
    for i in range(q):
        one = attend(plan("triton-invariant", pos[:, i:i + 1] + 1, slots, h // kvh),
                     qs[:, i:i + 1].transpose(1, 2), k, v)
        assert torch.equal(one[:, 0], verify[:, i]), i


def test_split_tokens_must_cover_the_prefix():
    q = torch.randn(1, 1, 1, 2, 16, device=DEV)
    kc = torch.randn(1, 64, 2, 16, device=DEV)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    lens = torch.tensor([40], dtype=torch.int32, device=DEV)
    for bad in (8, 24):  # 2 x 16 < 64 slots; 24 not a multiple of the key tile (16 on CPU)
        with pytest.raises(ValueError, match="split_tokens"):
            ka.branch_attention(q, kc, kc, table, lens, num_splits=2, split_tokens=bad,
                                block_n=16)
    a = ka.branch_attention(q, kc, kc, table, lens, num_splits=2, split_tokens=32, block_n=16)
    torch.testing.assert_close(a, ka.branch_attention(q, kc, kc, table, lens), **TOL)


def test_invariant_decoder_is_token_identical(qwen3_target):
    """FastDecoder(invariant=True): "triton" becomes "triton-invariant", the LM head runs through
    specdec_kernels.matmul; greedy DFlash output equals plain greedy decoding (fp32)."""
    import copy

    from dflash_plugin.fast import build_decoder, fast_generate
    from tests.conftest import fitted_drafter, greedy_reference

    drafter = fitted_drafter(qwen3_target, num_layers=1, block_size=8).to(DEV)
    target = copy.deepcopy(qwen3_target).to(DEV)
    prompts = [[5, 17, 29, 41], [9, 8, 7, 6, 5, 4]]
    dec = build_decoder(target, drafter, batch=2, max_len=64, graphs=False, attention="triton",
                        invariant=True)
    assert dec.attention == "triton-invariant"
    res = fast_generate(dec, prompts, block_size=8, max_new_tokens=12)
    assert res.tokens == greedy_reference(target, prompts, 12)
    ar = fast_generate(dec, prompts, block_size=1, max_new_tokens=12, proposer="ar")
    assert ar.tokens == res.tokens


def test_invariant_decoder_bf16_verify_equals_decode(qwen3_target):
    """bf16: with invariant=True a 16-token verify computes each position as the 1-token decode
    does (matmuls, RMSNorm, attention), so DFlash and n-gram output equal plain decoding of the
    same runtime token for token; and the target's layers run the invariant ops."""
    import copy

    from dflash_plugin.fast import build_decoder, fast_generate
    from tests.conftest import fitted_drafter

    drafter = fitted_drafter(qwen3_target, num_layers=1, block_size=16)
    target = copy.deepcopy(qwen3_target).to(DEV, torch.bfloat16)
    drafter = drafter.to(DEV, torch.bfloat16)
    prompts = [[5, 17, 29, 41], [9, 8, 7, 6, 5, 4]]
    dec = build_decoder(target, drafter, batch=2, max_len=64, graphs=False, attention="triton",
                        invariant=True)
    assert dec.ops.rms_norm.__module__ == "specdec_kernels.norm"
    ar = fast_generate(dec, prompts, block_size=1, max_new_tokens=10, proposer="ar").tokens
    assert fast_generate(dec, prompts, block_size=16, max_new_tokens=10).tokens == ar
    assert fast_generate(dec, prompts, block_size=16, max_new_tokens=10,
                         proposer="ngram").tokens == ar
