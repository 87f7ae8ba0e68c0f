"""The sampling filters every package shares (torch only): top-k on scores, top-p (nucleus) on
probabilities, banned ids on logits. DFlash's target/drafter transform
(`dflash_plugin.sampling.sampling_probs`) and Spiffy's denoising step
(`spiffy_plugin.decode.step_distribution`) call the first two; every dLLM forward (Spiffy's
runner and replay, SpecFold's folded forwards) bans the mask / pad ids with `ban_tokens`.
`gumbel_keys` are the Gumbel-max keys (fp64 noise) behind every sample of this kind: `race_sample`
draws one exact sample per row with a temperature per row (DFLASH_TREE's acceptance at T > 0 in
SGLang), `dflash_plugin.tree.sample_ranks` a tree's siblings.

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


RACE_CHUNK = 1 << 24  # elements of fp64 noise at a time (128 MB), so a large batch stays bounded


def gumbel_keys(
    scores: torch.Tensor,  # [..., vocab] log-probabilities up to a constant per row
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [..., vocab] fp64: scores + Gumbel(0, 1) noise, i.i.d.
    """The Gumbel-max keys: their argmax is one exact sample of softmax(scores), their top k a
    sample of k tokens without replacement, in draw order. The noise is -log E with E ~ Exp(1)
    drawn in fp64: in fp32 the Gumbel tail stops near 16.6 (torch's CUDA exponential returns no
    E below eps / 2), and at a 150k vocabulary about 1 % of the rows would hold such a cut
    value."""
    e = torch.empty(scores.shape, dtype=torch.float64, device=scores.device)
    return scores.double() - e.exponential_(generator=generator).log_()  # out of place


def race_sample(
    logits: torch.Tensor,  # [..., vocab]
    temperature: torch.Tensor,  # broadcast to logits[..., :1]: > 0 (a greedy row's is ignored)
    greedy: torch.Tensor | None = None,  # broadcast to logits[..., 0] bool: argmax there
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [...] long
    """One exact sample per row of softmax(logits / temperature), with no host sync and shapes
    that depend on the input's only (it can run inside a CUDA graph): the argmax of
    `gumbel_keys(logits / T)`, RACE_CHUNK elements at a time."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # [N, vocab]
    temp = temperature.expand(*logits.shape[:-1], 1).reshape(-1, 1)  # [N, 1]
    pick = torch.empty(flat.shape[0], dtype=torch.long, device=logits.device)
    step = max(1, RACE_CHUNK // vocab)
    for i in range(0, flat.shape[0], step):
        rows = flat[i:i + step].double() / temp[i:i + step]
        pick[i:i + step] = gumbel_keys(rows, generator).argmax(-1)
    pick = pick.view(logits.shape[:-1])
    return pick if greedy is None else torch.where(greedy, logits.argmax(-1), pick)
