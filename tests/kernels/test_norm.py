"""specdec_kernels.norm.invariant_rms_norm against reference.rms_norm on odd shapes (rows 1 / 7 /
16 / 33, D 45 / 64 / 384, a weight row per head), and its row invariance: a row normalised alone
is bitwise equal to the same row in a batch of 16 or 33. Tolerance: fp32 atol = rtol = 1e-5
(rsqrt vs 1 / sqrt); bf16 one bf16 ulp (atol = rtol = 1.6e-2)."""

import pytest
import torch

from tests.kernels._util import DEV, direct

pytestmark = direct
norm = pytest.importorskip("specdec_kernels.norm")
from specdec_kernels import reference  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _xw(shape, wshape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(DEV, dtype)
    w = (1 + 0.1 * torch.randn(*wshape, generator=g)).to(DEV, dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 16, 33])
@pytest.mark.parametrize("d", [45, 64, 384])
def test_matches_reference(rows, d, dtype):
    x, w = _xw((rows, d), (d,), dtype)
    got = norm.invariant_rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, reference.rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_per_head_and_strided_input(dtype):
    qkv, w = _xw((2, 5, 10, 16), (6, 16), dtype, seed=1)  # [batch, q, heads + 2 kv, head_dim]
    x = qkv[:, :, :6]  # a strided view: the q and k heads, as in a layer
    torch.testing.assert_close(norm.invariant_rms_norm(x, w, 1e-6),
                               reference.rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_do_not_depend_on_the_batch(dtype):
    x, w = _xw((33, 384), (384,), dtype, seed=2)
    full = norm.invariant_rms_norm(x, w, 1e-6)
    sixteen = norm.invariant_rms_norm(x[:16], w, 1e-6)
    for i in range(16):
        alone = norm.invariant_rms_norm(x[i:i + 1], w, 1e-6)[0]
        assert torch.equal(alone, sixteen[i]) and torch.equal(alone, full[i]), i


def test_bad_input():
    x, w = _xw((4, 8), (8,), torch.float32)
    with pytest.raises(ValueError, match="weight: shape"):
        norm.invariant_rms_norm(x, w[:7], 1e-6)
    with pytest.raises(ValueError, match="weight: shape"):
        norm.invariant_rms_norm(x, torch.ones(3, 8, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="weight: dtype"):
        norm.invariant_rms_norm(x, w.double(), 1e-6)
