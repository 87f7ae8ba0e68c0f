"""Ahead-of-time compile of the batch-invariant linear and RMSNorm kernels for sm_90 (see
test_compile.py: what the interpreter accepts but the compiler rejects), at the GPU config."""

import pytest

from tests.kernels._util import CUDA, INTERPRETED

pytestmark = pytest.mark.skipif(INTERPRETED or CUDA, reason="interpreted here, or a GPU compiles "
                                "the kernel for real in test_matmul.py")
pytest.importorskip("triton")
from tests.kernels.test_compile import compile_sm90, private_cache  # noqa: E402, F401


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_linear_kernel_compiles(dtype):
    import torch
    from specdec_kernels import matmul
    bm, bn, bk = matmul.tile_config(torch.device("cuda"), getattr(torch, {
        "bf16": "bfloat16", "fp32": "float32"}[dtype]))
    p = f"*{dtype}"
    k = compile_sm90(matmul._linear_kernel, {"x_ptr": p, "w_ptr": p, "y_ptr": p},
                     dict(PREC="ieee" if dtype == "fp32" else "tf32", CPU=False, BM=bm, BN=bn,
                          BK=bk))
    assert k.metadata.shared <= 228 * 1024


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rms_norm_kernel_compiles(dtype):
    from specdec_kernels import norm
    p = f"*{dtype}"
    compile_sm90(norm._rms_norm_kernel, {"x_ptr": p, "w_ptr": p, "y_ptr": p, "eps": "fp32"},
                 dict(BLOCK=512))
