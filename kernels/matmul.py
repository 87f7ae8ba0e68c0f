"""Batch-invariant linear layer: y = x @ w.T, where each output row's value does not depend on
how many rows are in the batch (M) or what the other rows hold.

*Row-invariant*: row i of `invariant_linear(x, w)` is bitwise equal to `invariant_linear(x[i:i+1],
w)[0]`. cuBLAS picks its algorithm (tile shape, split-K, reduction order) from M, so a 16-query
verify and a 1-query decode of the same token round differently; here the tile shape (BM, BN, BK)
is fixed per device and dtype, never chosen from M, there is no split-K, and every output element
reduces over K in the same BK-chunk order into one fp32 accumulator. Rows beyond M load as zeros
and are not stored. Spec: `specdec_kernels.reference.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_tensor
from ._dot import dot_acc

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["M"])  # M varies per call (batch x queries): one compile for all
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sx_m, sw_n, sy_m,
                   PREC: tl.constexpr, CPU: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):  # the same chunk order for every row: no split-K
        k = k0 + rk
        k_ok = k < K
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * sx_m + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn.to(tl.int64)[None, :] * sw_n + k[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BK, BN] = w.T tile
        acc = dot_acc(x, w, acc, PREC, CPU)  # fp32 math and position-free rows on CPU
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * sy_m + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tile_config(device: torch.device, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BM, BN, BK): a function of the device and dtype only, never of M."""
    if device.type != "cuda":
        return 16, 32, 32  # the interpreter: small tiles run fastest
    return (64, 64, 64) if dtype != torch.float32 else (64, 64, 32)


def invariant_linear(
    x: torch.Tensor,  # [..., K] float (last dim contiguous)
    w: torch.Tensor,  # [N, K] same dtype (contiguous)
) -> torch.Tensor:  # [..., N] x.dtype
    """x @ w.T with a fixed per-row reduction order (module docstring); a drop-in for
    `F.linear(x, w)` without bias."""
    check_tensor("x", x, None, _FLOATS, contiguous=False, last_contiguous=True)
    check_tensor("w", w, 2, (x.dtype,), x.device)
    if x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x: last dim must equal w's K = {w.shape[1]}, got shape "
                         f"{tuple(x.shape)}")
    lead, k, n = x.shape[:-1], w.shape[1], w.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        if k == 0:
            return y.zero_().reshape(*lead, n)
        bm, bn, bk = tile_config(x.device, x.dtype)
        gpu = x.device.type == "cuda"
        _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, w, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0),
            PREC="ieee" if x.dtype == torch.float32 or not gpu else "tf32",
            CPU=not gpu, BM=bm, BN=bn, BK=bk)
    return y.reshape(*lead, n)
