"""SpecFold residual gate, fold-source resolution and compaction (Triton; spec in reference.py).

Terms (see kernels/reference.py): rho per (branch, position) against the parent branch at the same
position, *folded* = rho <= delta (roots never), *source* = flat row (branch * positions + n) of the
nearest recomputed ancestor, *rows* = the recomputed flat rows packed densely (ascending, -1 pad),
*slot* = compact index of each row's source, so `take_rows(y_compact, slot)` scatters results back
and hands every folded position its source's values in one pass. Requires parent[i] < i.
Launches: gate (one program per row), resolve (parallel), compact (one program per segment =
request: a chunked scan), slot (parallel). `compact_batch`: ONE capacity for all segments (one
program scans them in order) and a row -> segment map (SpecFold's batch-wide compaction).
Nothing syncs with the host; `count` stays on the device (CUDA-graph friendly).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._checks import check_shape, check_tensor, next_pow2

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


@triton.jit
def _gate_kernel(h_ptr, parent_ptr, rho_ptr, fold_ptr, T, N, D, delta, eps,
                 BR: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0) * BR + tl.arange(0, BR)  # flat (branch, position)
    ok = row < T
    b = row // N
    n = row % N
    par = tl.load(parent_ptr + b, mask=ok, other=-1).to(tl.int32)
    par_row = tl.maximum(par, 0) * N + n
    num = tl.zeros([BR, BLOCK_D], dtype=tl.float32)
    den = tl.zeros([BR, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        m = ok[:, None] & (offs < D)[None, :]
        x = tl.load(h_ptr + row.to(tl.int64)[:, None] * D + offs[None, :], mask=m,
                    other=0.0).to(tl.float32)
        p = tl.load(h_ptr + par_row.to(tl.int64)[:, None] * D + offs[None, :], mask=m,
                    other=0.0).to(tl.float32)
        num += (x - p) * (x - p)
        den += p * p
    rho = tl.sqrt(tl.sum(num, 1)) / tl.maximum(tl.sqrt(tl.sum(den, 1)), eps)
    rho = tl.where(par < 0, float("inf"), rho)
    tl.store(rho_ptr + row, rho, mask=ok)
    tl.store(fold_ptr + row, (rho <= delta).to(tl.int8), mask=ok)


@triton.jit
def _resolve_kernel(fold_ptr, parent_ptr, src_ptr, T, N, NB, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < T
    n = r % N
    cur = r // N
    for _ in range(NB):  # a fold chain is at most NB - 1 long
        f = tl.load(fold_ptr + cur * N + n, mask=ok, other=0)
        par = tl.load(parent_ptr + cur, mask=ok, other=0).to(tl.int32)
        cur = tl.where((f != 0) & (par >= 0), par, cur)
    tl.store(src_ptr + r, cur * N + n, mask=ok)


@triton.jit
def _compact_kernel(src_ptr, rows_ptr, rank_ptr, count_ptr, S, CAP, BLOCK: tl.constexpr):
    seg = tl.program_id(0)  # one program per segment (request): a chunked scan of its S rows
    base = seg * S
    out0 = seg * CAP
    carry = tl.full([], 0, tl.int32)
    for start in range(0, S, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ok = i < S
        r = base + i
        s = tl.load(src_ptr + r, mask=ok, other=-1)
        keep = (s == r) & ok
        rank = carry + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(rows_ptr + out0 + rank, r, mask=keep & (rank < CAP))
        tl.store(rank_ptr + r, rank, mask=keep)
        carry += tl.sum(keep.to(tl.int32), 0)
    tl.store(count_ptr + seg, carry)
    for start in range(0, CAP, BLOCK):  # pad: disjoint from the slots written above
        i = start + tl.arange(0, BLOCK)
        tl.store(rows_ptr + out0 + i, tl.full([BLOCK], -1, tl.int32), mask=(i < CAP) & (i >= carry))


@triton.jit
def _compact_batch_kernel(src_ptr, rows_ptr, req_ptr, rank_ptr, count_ptr, NSEG, S, CAP,
                          BLOCK: tl.constexpr):
    # one program: a chunked scan of every segment in order; ranks are batch-wide
    carry = tl.full([], 0, tl.int32)
    for seg in range(NSEG):
        before = carry
        for start in range(0, S, BLOCK):
            i = start + tl.arange(0, BLOCK)
            ok = i < S
            r = seg * S + i
            s = tl.load(src_ptr + r, mask=ok, other=-1)
            keep = (s == r) & ok
            rank = carry + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(rows_ptr + rank, r, mask=keep & (rank < CAP))
            tl.store(req_ptr + rank, tl.zeros([BLOCK], tl.int32) + seg, mask=keep & (rank < CAP))
            tl.store(rank_ptr + r, rank, mask=keep)
            carry += tl.sum(keep.to(tl.int32), 0)
        tl.store(count_ptr + seg, carry - before)
    for start in range(0, CAP, BLOCK):  # pad: disjoint from the slots written above
        i = start + tl.arange(0, BLOCK)
        pad = (i < CAP) & (i >= carry)
        tl.store(rows_ptr + i, tl.full([BLOCK], -1, tl.int32), mask=pad)
        tl.store(req_ptr + i, tl.full([BLOCK], -1, tl.int32), mask=pad)


@triton.jit
def _slot_kernel(src_ptr, rank_ptr, slot_ptr, T, S, CAP, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < T
    s = tl.load(src_ptr + r, mask=ok, other=0)
    rank = tl.load(rank_ptr + s, mask=ok, other=0)
    tl.store(slot_ptr + r, tl.where(rank < CAP, (s // S) * CAP + rank, -1), mask=ok)


@triton.jit
def _take_rows_kernel(x_ptr, idx_ptr, out_ptr, T, D, BR: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i_ok = i < T
    j = tl.load(idx_ptr + i, mask=i_ok, other=-1).to(tl.int64)
    m = (offs < D)[None, :]
    x = tl.load(x_ptr + tl.maximum(j, 0)[:, None] * D + offs[None, :], mask=m & (j >= 0)[:, None],
                other=0.0)
    tl.store(out_ptr + i.to(tl.int64)[:, None] * D + offs[None, :], x, mask=m & i_ok[:, None])


def _tile(device: torch.device, t: int, d: int, cpu_rows: int) -> tuple[int, int]:
    """(rows, columns) per program: 2 x <= 512 on a GPU (many programs fill the SMs), large tiles
    in the CPU interpreter (which runs programs one after another)."""
    gpu = device.type == "cuda"
    br = max(2, min(2 if gpu else cpu_rows, next_pow2(t)))
    return br, min(next_pow2(d), 512 if gpu else 2048)


def check_parent(parent: torch.Tensor) -> None:
    """parent [branches]: every entry -1 or an earlier branch (a forest in topological order).
    Reads the values on the host (a sync on GPU): hot loops check once, then pass validate=False."""
    ar = torch.arange(parent.shape[0], device=parent.device)
    bad = (parent < -1) | (parent >= ar)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"parent[{i}]: must be -1 or in [0, {i}), got {int(parent[i])}")


def gate(hidden: torch.Tensor, parent: torch.Tensor, delta: float = 0.1, eps: float = 1e-12,
         validate: bool = True):
    """hidden [branches, positions, dim] float, parent [branches] int (-1 root, else < index).
    Returns rho [branches, positions] fp32 (+inf for roots), folded [branches, positions] bool."""
    check_tensor("hidden", hidden, 3, _FLOATS)
    check_tensor("parent", parent, 1, _INTS, hidden.device)
    nb, n, d = hidden.shape
    check_shape("parent", parent, (nb,))
    if validate:
        check_parent(parent)
    if not delta >= 0:
        raise ValueError(f"delta: must be >= 0, got {delta}")
    rho = torch.empty(nb, n, dtype=torch.float32, device=hidden.device)
    folded = torch.empty(nb, n, dtype=torch.int8, device=hidden.device)
    if nb * n:
        br, bd = _tile(hidden.device, nb * n, d, 64)
        _gate_kernel[(triton.cdiv(nb * n, br),)](hidden, parent, rho, folded, nb * n, n, d,
                                                 float(delta), float(eps), BR=br, BLOCK_D=bd)
    return rho, folded.view(torch.bool)


def resolve_sources(folded: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """folded [branches, positions] bool, parent [branches] int
    -> src [branches, positions] int32 (flat source rows)."""
    check_tensor("folded", folded, 2, (torch.bool,))
    check_tensor("parent", parent, 1, _INTS, folded.device)
    nb, n = folded.shape
    check_shape("parent", parent, (nb,))
    src = torch.empty(nb, n, dtype=torch.int32, device=folded.device)
    t, block = nb * n, 256
    if t:
        _resolve_kernel[(triton.cdiv(t, block),)](folded.view(torch.int8), parent, src, t, n, nb,
                                                  BLOCK=block)
    return src


def compact(src: torch.Tensor, segments: int = 1, capacity: int | None = None):
    """src [branches, positions] int32 -> rows [segments * capacity] int32, slot [T] int32,
    count [segments] int32 (on the device); T = branches * positions.
    The branches form `segments` equal groups (requests; fold sources stay inside a group). Each
    group's recomputed rows go, ascending, to its `capacity` compact slots (default: all of its
    rows), then -1. With a smaller capacity, rows past it are dropped and slot is -1 for the rows
    whose source was dropped; count holds the true numbers, so count > capacity flags the overflow
    without a host sync (the caller re-runs with more capacity)."""
    check_tensor("src", src, 2, (torch.int32,))
    t = src.numel()
    if segments < 1 or src.shape[0] % segments:
        raise ValueError(f"segments: must be >= 1 and divide the {src.shape[0]} branches, got "
                         f"{segments}")
    per = t // segments
    cap = per if capacity is None else int(capacity)
    if not 0 <= cap <= per:
        raise ValueError(f"capacity: must lie in [0, {per}] (rows per segment), got {capacity}")
    dev = src.device
    rows = torch.empty(segments * cap, dtype=torch.int32, device=dev)
    slot = torch.empty(t, dtype=torch.int32, device=dev)
    rank = torch.empty(t, dtype=torch.int32, device=dev)
    count = torch.empty(segments, dtype=torch.int32, device=dev)
    _compact_kernel[(segments,)](src, rows, rank, count, per, cap, BLOCK=1024)
    if t:
        _slot_kernel[(triton.cdiv(t, 256),)](src, rank, slot, t, per, cap, BLOCK=256)
    return rows, slot, count


def compact_batch(src: torch.Tensor, segments: int, capacity: int):
    """src [branches, positions] int32 -> rows [capacity] int32, slot [T] int32, count
    [segments] int32, row_request [capacity] int32 (on the device); T = branches * positions.
    `compact` with ONE capacity shared by the whole batch: the recomputed rows of all segments
    (requests, equal groups of branches) go, ascending, to the first `capacity` slots (so each
    request's rows lie next to each other), then -1; row_request names each slot's segment (-1:
    padding). count holds the true per-segment numbers: sum(count) > capacity flags the overflow
    (rows past the capacity dropped, slot -1 for the rows whose source was dropped)."""
    check_tensor("src", src, 2, (torch.int32,))
    t = src.numel()
    if segments < 1 or src.shape[0] % segments:
        raise ValueError(f"segments: must be >= 1 and divide the {src.shape[0]} branches, got "
                         f"{segments}")
    cap = int(capacity)
    if not 0 <= cap <= t:
        raise ValueError(f"capacity: must lie in [0, {t}] (rows of the batch), got {capacity}")
    dev = src.device
    rows = torch.empty(cap, dtype=torch.int32, device=dev)
    req = torch.empty(cap, dtype=torch.int32, device=dev)
    slot = torch.empty(t, dtype=torch.int32, device=dev)
    rank = torch.empty(t, dtype=torch.int32, device=dev)
    count = torch.empty(segments, dtype=torch.int32, device=dev)
    per = t // segments
    block = max(16, min(1024, next_pow2(max(per, cap, 1))))
    _compact_batch_kernel[(1,)](src, rows, req, rank, count, segments, per, cap, BLOCK=block)
    if t:
        _slot_kernel[(triton.cdiv(t, 256),)](src, rank, slot, t, t, cap, BLOCK=256)
    return rows, slot, count, req


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [M, dim], idx [T] int32 (-1 = zero row; others must be < M) -> out [T, dim], x.dtype.
    Gather to the compact batch with idx = rows; scatter back (and fan out to folded rows) with
    idx = slot."""
    check_tensor("x", x, 2)
    check_tensor("idx", idx, 1, (torch.int32,), x.device)
    t, d = idx.shape[0], x.shape[1]
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if t and d:
        br, block_d = _tile(x.device, t, d, 64)
        _take_rows_kernel[(triton.cdiv(t, br), triton.cdiv(d, block_d))](x, idx, out, t, d, BR=br,
                                                                        BLOCK_D=block_d)
    return out


class FoldPlan(NamedTuple):
    rho: torch.Tensor  # [branches, positions] fp32
    folded: torch.Tensor  # [branches, positions] bool
    src: torch.Tensor  # [branches, positions] int32 flat source row
    rows: torch.Tensor  # [segments * capacity] int32 recomputed rows then -1 (per segment)
    slot: torch.Tensor  # [T] int32 compact index of each row's source (-1: dropped, overflow)
    count: torch.Tensor  # [segments] int32 number of recomputed rows


def fold_plan(hidden: torch.Tensor, parent: torch.Tensor, delta: float = 0.1,
              validate: bool = True, segments: int = 1,
              capacity: int | None = None) -> FoldPlan:
    """All four steps for one layer: hidden [branches, positions, dim], parent [branches];
    `segments` / `capacity` as in `compact`."""
    rho, folded = gate(hidden, parent, delta, validate=validate)
    src = resolve_sources(folded, parent)
    rows, slot, count = compact(src, segments, capacity)
    return FoldPlan(rho, folded, src, rows, slot, count)
