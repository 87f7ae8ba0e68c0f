"""The sampling filters every package shares (torch only): top-k on scores, top-p (nucleus) on
probabilities, banned ids on logits. DFlash's target/drafter transform
(`dflash_plugin.sampling.sampling_probs`) and Spiffy's denoising step
(`spiffy_plugin.decode.step_distribution`) call the first two; every dLLM forward (Spiffy's
runner and replay, SpecFold's folded forwards) bans the mask / pad ids with `ban_tokens`.

top-p keeps, in descending order of probability, every token whose preceding mass is < top_p
(so at least the most probable one), then renormalises.
"""

from __future__ import annotations

import torch


def top_k_filter(
    scores: torch.Tensor,  # [..., vocab] logits or scaled logits
    top_k: int,  # 0 (or >= vocab) keeps every token
) -> torch.Tensor:  # [..., vocab] scores, -inf below the k-th largest of each row
    if not 0 < top_k < scores.shape[-1]:
        return scores
    kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


def top_p_filter(
    probs: torch.Tensor,  # [..., vocab] rows sum to 1
    top_p: float,  # in (0, 1]; 1 keeps every token
) -> torch.Tensor:  # [..., vocab] rows sum to 1, zero outside each row's nucleus
    if top_p >= 1:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def ban_tokens(
    logits: torch.Tensor,  # [..., vocab]
    banned,  # token ids never to predict (mask, pad); empty: unchanged
) -> torch.Tensor:  # the same tensor, -inf at the banned ids (in place)
    if banned:
        logits[..., list(banned)] = float("-inf")
    return logits
