"""Vanilla and threshold decoding of a block-diffusion LM (the baseline Spiffy accelerates).

Each denoising step scores the current block in one forward and unmasks masked positions: the
S most confident (vanilla) or all above the threshold (at least one). A finished block is
committed in the same forward that scores the next block's first step, so NFE = denoising steps.
Generation stops at EOS (positions after an unmasked EOS are not decoded) or `max_new_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specdec_kernels.sampling import top_p_filter

from .errors import require
from .params import DecodeParams
from .runtime import BlockDiffusionRunner, DLLMSpec, dllm_spec


@dataclass
class DLLMResult:
    tokens: list[int]  # generated ids (prompt excluded, EOS included)
    nfe: int  # model forwards
    steps: int  # denoising steps taken
    stop_reason: str  # "eos" or "length"

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / self.nfe if self.nfe else 0.0


def step_distribution(
    logits: torch.Tensor,  # [block, vocab] fp32 (banned tokens already -inf)
    params: DecodeParams,
) -> torch.Tensor:  # [block, vocab] probabilities the step samples from / takes confidence of
    scores = logits / (params.temperature if not params.greedy else 1.0)
    probs = torch.softmax(scores, dim=-1)
    return probs if params.greedy else top_p_filter(probs, params.top_p)


def choose_unmask(
    probs: torch.Tensor,  # [block, vocab]
    decodable: torch.Tensor,  # [block] bool: masked positions this step may fill
    params: DecodeParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # positions [m] (confidence order), tokens [m]
    conf, best = probs.max(-1)
    decodable = decodable.to(probs.device)
    sampled = None if params.greedy else torch.multinomial(probs, 1, generator=generator)[:, 0]
    tokens = best if sampled is None else sampled
    conf = conf.masked_fill(~decodable, -1.0)
    order = torch.argsort(conf, descending=True, stable=True)
    n = int(decodable.sum())
    if params.threshold is not None:
        m = max(1, int((conf > params.threshold).sum()))
    else:
        m = min(params.unmask_per_step, n)
    pos = order[:m]
    return pos.cpu(), tokens[pos].cpu()  # the block's ids live on the host


def validate_prompt(prompt: list[int], max_new_tokens: int, spec: DLLMSpec) -> None:
    require(len(prompt) >= 1, "prompt", "is empty")
    require(max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    bs = spec.block_size
    end = -(-(len(prompt) + max_new_tokens) // bs) * bs
    require(end <= spec.max_positions, "max_new_tokens",
            f"prompt ({len(prompt)} tokens) + max_new_tokens={max_new_tokens}, rounded up to a "
            f"block of {bs}, exceeds the model's {spec.max_positions} positions")
    bad = [t for t in prompt if not 0 <= t < spec.vocab_size]
    require(not bad, "prompt", f"token ids {bad[:5]} outside [0, {spec.vocab_size})")


class BlockState:
    """The current block: ids [block_size], its absolute start, the decodable limit."""

    def __init__(self, ids: torch.Tensor, start: int, first_gen: int, limit: int, spec: DLLMSpec):
        self.ids, self.start, self.first_gen, self.limit, self.spec = ids, start, first_gen, \
            limit, spec

    def decodable(self) -> torch.Tensor:  # [block_size] bool
        pos = self.start + torch.arange(self.spec.block_size)
        ok = (self.ids == self.spec.mask_token_id) & (pos < self.limit)
        eos = self.spec.eos_token_id
        if eos is not None:
            hits = ((self.ids == eos) & (pos >= self.first_gen)).nonzero()
            if hits.numel():
                ok &= torch.arange(self.spec.block_size) < int(hits[0])
        return ok

    def generated(self) -> list[int]:
        lo = max(self.first_gen - self.start, 0)
        hi = min(self.limit - self.start, self.spec.block_size)
        return self.ids[lo:hi].tolist()


def finish_tokens(out: list[int], max_new_tokens: int, eos: int | None) -> tuple[list[int], str]:
    if eos is not None and eos in out:
        return out[: out.index(eos) + 1], "eos"
    return out[:max_new_tokens], "length"


@dataclass
class Decoding:
    """Per-request decoding state shared by vanilla decoding, Spiffy and calibration."""
    spec: DLLMSpec
    runner: BlockDiffusionRunner
    block: BlockState
    generator: torch.Generator
    max_new_tokens: int
    out: list[int]

    def finish_block(self, steps: int) -> DLLMResult | None:
        """Record the finished block's tokens; a result when generation is over, else None."""
        self.out += self.block.generated()
        tokens, reason = finish_tokens(self.out, self.max_new_tokens, self.spec.eos_token_id)
        if reason == "eos" or len(self.out) >= self.max_new_tokens:
            return DLLMResult(tokens, self.runner.nfe, steps, reason)
        return None

    def next_block(self) -> torch.Tensor:
        """Commit the finished block and score the next, fully masked one (one forward)."""
        bs = self.spec.block_size
        clean = self.block.ids
        ids = torch.full((bs,), self.spec.mask_token_id, dtype=torch.long)
        b = self.block
        self.block = BlockState(ids, b.start + bs, b.first_gen, b.limit, self.spec)
        return self.runner.forward(clean, ids[None])


def start_decoding(model, prompt: list[int], params: DecodeParams,
                   max_new_tokens: int) -> tuple[Decoding, torch.Tensor]:
    """Validate, commit the prompt's full blocks and score its last (partial) block: the state
    and the first forward's logits [1, block, vocab]."""
    spec = dllm_spec(model.config)
    validate_prompt(prompt, max_new_tokens, spec)
    gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    runner = BlockDiffusionRunner(model, spec)
    bs, p_len = spec.block_size, len(prompt)
    start = (p_len // bs) * bs
    ids = torch.full((bs,), spec.mask_token_id, dtype=torch.long)
    ids[: p_len - start] = torch.tensor(prompt[start:], dtype=torch.long)
    block = BlockState(ids, start, p_len, p_len + max_new_tokens, spec)
    logits = runner.forward(torch.tensor(prompt[:start], dtype=torch.long), ids[None])
    return Decoding(spec, runner, block, gen, max_new_tokens, []), logits


@torch.inference_mode()
def generate(model, prompt: list[int], params: DecodeParams = DecodeParams(),
             max_new_tokens: int = 128) -> DLLMResult:
    """Vanilla (S per step) or threshold decoding of one prompt."""
    st, logits = start_decoding(model, prompt, params, max_new_tokens)
    steps = 0
    while True:
        block = st.block
        pos, toks = choose_unmask(step_distribution(logits[0], params), block.decodable(),
                                  params, st.generator)
        block.ids[pos] = toks.cpu()
        steps += 1
        if block.decodable().any():
            logits = st.runner.forward(block.ids[:0], block.ids[None])
            continue
        done = st.finish_block(steps)
        if done is not None:
            return done
        logits = st.next_block()
