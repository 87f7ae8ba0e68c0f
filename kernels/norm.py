"""Batch-invariant RMSNorm: each row is normalised by one program with a fixed tile, so its value
does not depend on how many rows are in the call.

torch's CUDA reduction picks its threads per row from the number of rows (e.g. 64 threads for
1-8 rows of 384 values, 32 for 16 rows), so `x.pow(2).mean(-1)` of one row rounds differently in
a 1-token decode and in a 16-token verify. Here one program reduces one row over a BLOCK fixed
by the row length, in the same order for every call. Same math as HF Qwen3RMSNorm: fp32
normalisation, cast to x.dtype, then `weight *` in x.dtype. Spec: `reference.rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_tensor, next_pow2

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["R"])  # R (rows) varies per call: one compile for all
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, R, D, WR, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    ok = d < D
    x = tl.load(x_ptr + row.to(tl.int64) * D + d, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    xn = (xf * r).to(x.dtype)
    w = tl.load(w_ptr + (row % WR) * D + d, mask=ok, other=0.0)
    y = (w.to(tl.float32) * xn.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row.to(tl.int64) * D + d, y, mask=ok)


def invariant_rms_norm(
    x: torch.Tensor,  # [..., D] float
    weight: torch.Tensor,  # [D], or [WR, D] with x [..., WR, D] (a weight row per head)
    eps: float,
) -> torch.Tensor:  # x's shape and dtype
    """`weight * rms_normalise(x)` with a per-row order that does not depend on the batch."""
    check_tensor("x", x, None, _FLOATS, contiguous=False)
    check_tensor("weight", weight, None, (x.dtype,), x.device)
    d = x.shape[-1]
    wr = 1 if weight.dim() == 1 else weight.shape[0]
    if weight.dim() not in (1, 2) or weight.shape[-1] != d or (
            wr > 1 and (x.dim() < 2 or x.shape[-2] != wr)):
        raise ValueError(f"weight: shape {tuple(weight.shape)} must be [{d}] or [heads, {d}] "
                         f"matching x's last two dims {tuple(x.shape[-2:])}")
    x2 = x.reshape(-1, d).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0] and d:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.shape[0], d, wr, float(eps),
                                         BLOCK=next_pow2(d))
    return y.view(x.shape)
