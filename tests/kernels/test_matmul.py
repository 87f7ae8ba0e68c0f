"""specdec_kernels.matmul.invariant_linear against reference.linear on odd shapes (M 1 / 7 / 16 /
33; K and N not multiples of the tiles), and its row invariance: row i computed in a batch of M
rows is bitwise equal to the same row computed alone (M = 1) and next to different other rows.
Tolerance: fp32 atol = rtol = 1e-5 (ieee dots; only the summation order differs from the float64
reference); bf16 one bf16 ulp of the fp32 result (atol = rtol = 1.6e-2)."""

import pytest
import torch

from tests.kernels._util import DEV, direct

pytestmark = direct
matmul = pytest.importorskip("specdec_kernels.matmul")
from specdec_kernels import reference  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _xw(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 7, 16, 33])
@pytest.mark.parametrize("k,n", [(45, 77), (96, 33), (130, 64)])
def test_matches_reference_on_odd_shapes(m, k, n, dtype):
    x, w = _xw(m, k, n, dtype)
    got = matmul.invariant_linear(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, reference.linear(x, w), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_do_not_depend_on_the_batch(dtype):
    """Row i alone (M = 1), in a batch of 16, in a batch of 33 and next to other rows: the same
    bits. (torch's matmul does not promise this: its algorithm depends on M.)"""
    k, n = 100, 70
    x, w = _xw(33, k, n, dtype, seed=1)
    full = matmul.invariant_linear(x, w)
    sixteen = matmul.invariant_linear(x[:16], w)
    other = x.clone()
    other[1::2] = torch.randn(other[1::2].shape, generator=torch.Generator().manual_seed(5)).to(
        other)
    mixed = matmul.invariant_linear(other, w)
    for i in range(16):
        alone = matmul.invariant_linear(x[i:i + 1], w)[0]
        assert torch.equal(alone, sixteen[i]) and torch.equal(alone, full[i]), i
        if i % 2 == 0:
            assert torch.equal(alone, mixed[i]), i


def test_leading_dims_views_and_bad_input():
    x, w = _xw(12, 40, 24, torch.float32, seed=2)
    x3 = x.view(3, 4, 40)
    got = matmul.invariant_linear(x3, w)
    assert got.shape == (3, 4, 24)
    torch.testing.assert_close(got.reshape(12, 24), reference.linear(x, w), **TOL[torch.float32])
    wide = torch.randn(12, 80, device=DEV)
    view = wide[:, :40]  # rows strided, last dim contiguous
    torch.testing.assert_close(matmul.invariant_linear(view, w), reference.linear(view, w),
                               **TOL[torch.float32])
    assert matmul.invariant_linear(x[:0], w).shape == (0, 24)
    with pytest.raises(ValueError, match="x: last dim"):
        matmul.invariant_linear(x[:, :39], w)
    with pytest.raises(ValueError, match="w: dtype"):
        matmul.invariant_linear(x, w.double())
    with pytest.raises(ValueError, match="x: dtype"):
        matmul.invariant_linear(x.long(), w)
