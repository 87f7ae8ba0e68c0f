"""Lossless verification of a drafted block against one target forward.

Terms: a round drafts `g` tokens after the anchor; the target scores all g + 1 positions. The
*accepted* length `a` (0..g) is the longest draft prefix the target keeps; the *bonus* token is the
target's own token at position `a` (a correction when a < g, a free extra token when a == g).
"""

from __future__ import annotations

import torch


def verify_greedy(
    draft_ids: torch.Tensor,  # [batch, g]
    target_logits: torch.Tensor,  # [batch, g + 1, vocab]
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [batch], bonus [batch]
    """Accept while the draft equals the target's argmax; bonus = argmax at the first miss."""
    target_ids = target_logits.argmax(-1)  # [batch, g + 1]
    match = (draft_ids == target_ids[:, :-1]).to(torch.int64)
    accepted = match.cumprod(-1).sum(-1)
    bonus = target_ids.gather(1, accepted[:, None])[:, 0]
    return accepted, bonus


def verify_rejection(
    draft_ids: torch.Tensor,  # [batch, g]
    draft_probs: torch.Tensor | None,  # [batch, g, vocab] q; None = deterministic proposer
    target_probs: torch.Tensor,  # [batch, g + 1, vocab] p (same transform as q)
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [batch], bonus [batch]
    """Speculative rejection sampling: keep x with prob min(1, p(x) / q(x)); on the first
    rejection sample from normalize(max(0, p - q)); after a full accept sample from p."""
    b, g = draft_ids.shape
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_ids, vocab).to(target_probs.dtype)
    p_x = target_probs[:, :g].gather(-1, draft_ids[..., None])[..., 0]  # [batch, g]
    q_x = draft_probs.gather(-1, draft_ids[..., None])[..., 0]
    u = torch.rand(b, g, generator=generator, device=draft_ids.device)
    keep = (u * q_x < p_x).to(torch.int64)
    accepted = keep.cumprod(-1).sum(-1)  # [batch]
    q_pad = torch.cat([draft_probs, draft_probs.new_zeros(b, 1, vocab)], dim=1)
    rows = torch.arange(b, device=draft_ids.device)
    p_a = target_probs[rows, accepted]  # [batch, vocab]
    residual = (p_a - q_pad[rows, accepted]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_a)
    bonus = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return accepted, bonus
