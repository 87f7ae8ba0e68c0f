"""Tile products shared by the kernels, with a CPU path for the Triton interpreter.

The interpreter runs `tl.dot` as numpy's matmul, and OpenBLAS (e.g. its Haswell kernels) rounds
an output row differently depending on the row's position in the tile. That breaks the
batch-invariance the kernels promise (a query's bits must not depend on its neighbours) on CPU
only. With CPU set, a product is the broadcast a[:, :, None] * b[None, :, :] summed over K in
fp32: every output element then reduces its K products in the same order wherever its row sits.
On GPU (CPU unset) the branch is pruned at compile time and `tl.dot` runs as before.
"""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, PREC: tl.constexpr, CPU: tl.constexpr):
    # a [BM, BK], b [BK, BN] -> [BM, BN] fp32
    if CPU:
        out = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def dot_acc(a, b, acc, PREC: tl.constexpr, CPU: tl.constexpr):
    # acc [BM, BN] fp32 += a [BM, BK] @ b [BK, BN]
    if CPU:
        acc += dot(a, b, PREC, CPU)
    else:  # the accumulating form: GPU bits as before
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc
