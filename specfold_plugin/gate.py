"""SpecFold's residual gate and fold-source resolution (torch reference; kernels mirror these).

A *branch tree*: branch 0 is the root (the real current block, parent -1, never folded), branch
i >= 1 has a parent branch parents[i] < i. At one sublayer input h, position n of branch i is
*folded* when rho = ||h[i, n] - h[par(i), n]|| / ||h[par(i), n]|| <= delta; a folded position takes
the projections of its *source*: the nearest ancestor (itself when recomputed) whose position n
was recomputed. Fold chains (a folded child of a folded parent) resolve through the chain.
"""

from __future__ import annotations

import math

import torch

from spiffy_plugin.errors import require


def check_delta(delta: float) -> float:
    """delta is the relative-residual threshold; 0 folds only positions with identical input."""
    require(isinstance(delta, (int, float)) and not isinstance(delta, bool), "delta",
            f"must be a number, got {delta!r}")
    require(not math.isnan(delta) and 0 <= delta < math.inf, "delta",
            f"must be a finite number >= 0, got {delta}")
    return float(delta)


def check_parents(parents: list[int]) -> None:
    require(len(parents) >= 1 and parents[0] == -1, "parents",
            f"branch 0 must be the root (parent -1), got {parents[:1]}")
    bad = [i for i, p in enumerate(parents[1:], 1) if not 0 <= p < i]
    require(not bad, "parents", f"branch {bad[:1]} needs a parent in [0, i) (got "
            f"{[parents[i] for i in bad[:1]]}): parents come before their children")


def relative_residual(
    h: torch.Tensor,  # [k, n, d] sublayer input of every branch
    parents: torch.Tensor,  # [k] long, parents[0] = -1
) -> torch.Tensor:  # [k, n] fp32 rho; 0 where the root (no parent) or both rows are zero
    par = h[parents.clamp(min=0)].float()
    diff = (h.float() - par).norm(dim=-1)
    base = par.norm(dim=-1)
    rho = torch.where(diff == 0, torch.zeros_like(diff), diff / base)
    rho[0] = 0.0
    return rho


def gate(
    h: torch.Tensor,  # [k, n, d]
    parents: torch.Tensor,  # [k] long, parents[0] = -1
    delta: float,
) -> torch.Tensor:  # [k, n] bool: True = folded (the root never is)
    fold = relative_residual(h, parents) <= delta  # NaN compares False: recomputed
    fold[0] = False
    return fold


def gate_vs_source(
    h: torch.Tensor,  # [k, n, d]
    parents: torch.Tensor,  # [k] long, parents[0] = -1, parents[i] < i
    delta: float,
) -> torch.Tensor:  # [k, n] bool: True = folded (the root never is)
    """A variant of `gate` (not the issue's rule, an experiment): rho is measured against the
    row whose projections a fold would reuse, i.e. the parent's source (nearest recomputed
    ancestor), not the parent itself, so that a chain of folds cannot drift by delta per hop.
    Branch by branch in tree order (a loop over k; no kernel yet)."""
    k, n, _ = h.shape
    hf = h.float()
    col = torch.arange(n, device=h.device)
    src = torch.arange(k, device=h.device)[:, None].repeat(1, n)  # [k, n]
    fold = torch.zeros(k, n, dtype=torch.bool, device=h.device)
    for i in range(1, k):
        cand = src[int(parents[i])]  # [n] the parent's source per position
        ref = hf[cand, col]  # [n, d]
        diff = (hf[i] - ref).norm(dim=-1)
        rho = torch.where(diff == 0, torch.zeros_like(diff), diff / ref.norm(dim=-1))
        fold[i] = rho <= delta
        src[i] = torch.where(fold[i], cand, torch.full_like(cand, i))
    return fold


def resolve_sources(
    fold: torch.Tensor,  # [k, n] bool, fold[0] all False
    parents: torch.Tensor,  # [k] long, parents[i] < i
) -> torch.Tensor:  # [k, n] long: branch whose projections position n of branch i uses
    """Pointer jumping: each round a folded entry moves to its pointer's pointer, so chains of up
    to k - 1 hops resolve in ceil(log2(k)) rounds (a fixed count: no host sync, no branch order)."""
    k, n = fold.shape
    own = torch.arange(k, device=fold.device)[:, None].expand(k, n)
    ptr = torch.where(fold, parents.clamp(min=0)[:, None].expand(k, n), own)
    col = torch.arange(n, device=fold.device)[None].expand(k, n)
    for _ in range(max(1, math.ceil(math.log2(max(k, 2))))):
        ptr = ptr[ptr, col]
    return ptr


def source_rows(
    sources: torch.Tensor,  # [k, n] long
    recompute: torch.Tensor,  # [k, n] bool (= ~fold)
) -> tuple[torch.Tensor, torch.Tensor]:  # rows [R] (flat i*n+pos), gather [k*n] into rows
    """Compaction: the flat indices of the recomputed rows, and for every (branch, position)
    the index into those R compact rows of its source."""
    k, n = recompute.shape
    rows = recompute.reshape(-1).nonzero()[:, 0]
    slot = torch.full((k * n,), -1, dtype=torch.long, device=rows.device)
    slot[rows] = torch.arange(rows.numel(), device=rows.device)
    flat_src = sources * n + torch.arange(n, device=sources.device)[None]
    return rows, slot[flat_src.reshape(-1)]
