"""Reference speculative generation loop: prefill, then rounds of draft -> verify -> accept.

Each round drafts g <= B - 1 tokens after the row's *anchor* (its last committed token, not yet in
the target cache), verifies the g + 1 block tokens in ONE target forward, commits the accepted
prefix plus the bonus token, and crops both caches to the committed tokens. Rows are ragged: they
differ in prompt length, accepted length and finish time; finished rows leave the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .config import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from .errors import require
from .metrics import AggregateMetrics, GenerationResult, RequestMetrics
from .proposers import Proposer
from .sampling import SamplingParams, pick_tokens, sampling_probs
from .target import TargetRunner
from .verify import verify_greedy, verify_rejection


def validate_request(prompts: list[list[int]], max_new_tokens: int, block_size: int,
                     vocab_size: int, max_positions: int) -> None:
    require(len(prompts) >= 1, "prompts", "at least one prompt is required")
    require(MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE, "block_size",
            f"must be in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size}")
    require(max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        require(len(p) >= 1, "prompt", f"prompt {i} is empty")
        require(len(p) < max_positions, "prompt",
                f"prompt {i} has {len(p)} tokens; the model has {max_positions} positions")
        require(len(p) + max_new_tokens <= max_positions, "max_new_tokens",
                f"prompt {i} ({len(p)} tokens) + max_new_tokens={max_new_tokens} exceeds the "
                f"model's {max_positions} positions")
        bad = [t for t in p if not 0 <= t < vocab_size]
        require(not bad, "prompt", f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        valid[i, width - len(p):] = True
    return ids, valid


@torch.inference_mode()
def speculative_generate(
    target: torch.nn.Module,  # Hugging Face causal LM
    proposer: Proposer,
    prompts: list[list[int]],
    *,
    block_size: int = 16,
    max_new_tokens: int = 128,
    params: SamplingParams = SamplingParams(),
    stop_token_ids: tuple[int, ...] = (),
    fast: bool | None = None,
) -> GenerationResult:
    """`fast`: use the static-cache CUDA-graph runtime (`dflash_plugin.fast`); None = use it
    when it applies (CUDA device, greedy, DFlash proposer, Qwen3 target), False = reference."""
    cfg = target.config
    validate_request(prompts, max_new_tokens, block_size, cfg.vocab_size,
                     cfg.max_position_embeddings)
    device = target.get_input_embeddings().weight.device
    if _use_fast(fast, device, target, proposer, params, stop_token_ids):
        return _fast_generate(target, proposer, prompts, block_size, max_new_tokens,
                              stop_token_ids, graphs=device.type == "cuda")
    lp = start_loop(target, proposer, prompts, params, stop_token_ids)
    runner, gen, stops, agg, out, t_start = lp.runner, lp.gen, lp.stops, lp.agg, lp.out, lp.t_start
    while True:
        if not lp.drop_finished(max_new_tokens):
            break
        rows, anchor, anchor_pos = lp.rows, lp.anchor, lp.anchor_pos
        remaining = [max_new_tokens - len(out[r]) for r in rows]
        # Same rule as the z-lab loop: draft up to the tokens still needed (the bonus may then be
        # cut); the drafter sees the block length, so this choice changes its proposals.
        g = min(block_size - 1, max(remaining))

        t0 = time.perf_counter()
        draft, q = proposer.propose(anchor, anchor_pos, g, params, gen)  # g >= 1 here
        _sync(device)
        t1 = time.perf_counter()
        block = torch.cat([anchor[:, None], draft], dim=1)  # [batch, g + 1]
        positions = anchor_pos[:, None] + torch.arange(g + 1, device=device)
        logits, feats = runner.verify(block, positions)
        if params.greedy:
            accepted, bonus = verify_greedy(draft, logits)
        else:
            accepted, bonus = verify_rejection(draft, q, sampling_probs(logits, params), gen)
        new_tokens = torch.cat([draft, bonus[:, None]], dim=1)  # bonus lands at index accepted
        new_tokens.scatter_(1, accepted[:, None], bonus[:, None])
        produced = _commit_tokens(new_tokens.tolist(), accepted.tolist(), remaining, stops, out,
                                  rows, agg, g)
        produced_t = torch.tensor(produced, device=device)
        keep_slots = torch.arange(g + 1, device=device)[None, :] < produced_t[:, None]
        runner.commit(keep_slots)
        proposer.observe(block, feats, positions, keep_slots)
        last = produced_t - 1
        lp.anchor = new_tokens.gather(1, last[:, None])[:, 0]
        lp.anchor_pos = anchor_pos + produced_t
        _sync(device)
        agg.draft_seconds += t1 - t0
        agg.verify_seconds += time.perf_counter() - t1

    agg.total_seconds = time.perf_counter() - t_start
    return GenerationResult(tokens=out, metrics=agg)


@dataclass
class Loop:
    """What the reference loops (linear and tree) share after prefill: the target runner, the
    live rows (`rows`: request index of each batch row) with their anchor token and position,
    outputs, metrics, the random stream and the stop set."""

    runner: TargetRunner
    proposer: Proposer
    gen: torch.Generator
    stops: set[int]
    agg: AggregateMetrics
    out: list[list[int]]
    rows: list[int]
    anchor: torch.Tensor  # [rows] long
    anchor_pos: torch.Tensor  # [rows] long
    t_start: float

    def drop_finished(self, max_new_tokens: int) -> bool:
        """Remove finished rows from both caches; False when no row is left."""
        done = _finished_rows(self.out, self.rows, self.stops, max_new_tokens, self.agg)
        if not done:
            return True
        keep = torch.tensor([i for i in range(len(self.rows)) if i not in done],
                            device=self.anchor.device)
        if keep.numel() == 0:
            return False
        self.rows = [self.rows[i] for i in keep.tolist()]
        self.runner.select_rows(keep)
        self.proposer.select_rows(keep)
        self.anchor, self.anchor_pos = self.anchor[keep], self.anchor_pos[keep]
        return True


def start_loop(target, proposer: Proposer, prompts: list[list[int]], params: SamplingParams,
               stop_token_ids: tuple[int, ...]) -> Loop:
    """Prefill every prompt (left-padded), pick each row's first token, start the proposer."""
    device = target.get_input_embeddings().weight.device
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    agg = AggregateMetrics([RequestMetrics(prompt_tokens=len(p)) for p in prompts])
    out: list[list[int]] = [[] for _ in prompts]
    t_start = time.perf_counter()
    runner = TargetRunner(target, proposer.layer_ids)
    ids, valid = _left_pad(prompts, getattr(target.config, "pad_token_id", None) or 0, device)
    logits, feats = runner.prefill(ids, valid)
    first = pick_tokens(logits[:, -1], params, gen)  # [batch]
    proposer.start(runner, ids, feats, (valid.long().cumsum(-1) - 1).clamp_min(0), valid)
    _sync(device)
    agg.prefill_seconds = time.perf_counter() - t_start
    for r, tok in enumerate(first.tolist()):
        out[r].append(tok)
    return Loop(runner, proposer, gen, set(stop_token_ids), agg, out, list(range(len(prompts))),
                first, torch.tensor([len(p) for p in prompts], device=device), t_start)


def _use_fast(fast, device, target, proposer, params, stops) -> bool:
    from .fast import supports
    from .fast.accept import MAX_STOPS
    from .proposers import DFlashProposer

    ok = (params.greedy and isinstance(proposer, DFlashProposer) and supports(target)
          and len(stops) <= MAX_STOPS)
    if fast is None:
        return ok and device.type == "cuda"
    require(not fast or ok, "fast", "the fast runtime needs greedy sampling, a DFlash proposer, "
            f"a bias-free Qwen3 target with default RoPE and <= {MAX_STOPS} stop tokens")
    return fast


def _fast_generate(target, proposer, prompts, block_size, max_new_tokens, stops, graphs):
    from .fast import build_decoder, fast_generate

    width = max(len(p) for p in prompts)
    dec = build_decoder(target, proposer.drafter, batch=len(prompts),
                        max_len=width + max_new_tokens + block_size, max_block=block_size,
                        graphs=graphs)
    return fast_generate(dec, prompts, block_size=block_size, max_new_tokens=max_new_tokens,
                         stop_token_ids=tuple(stops))


def _commit_tokens(new_tokens, accepted, remaining, stops, out, rows, agg, g) -> list[int]:
    """Append each row's accepted drafts + bonus, capped by max_new_tokens and cut after the first
    stop token. Returns the number of tokens each row committed."""
    produced = []
    for i, r in enumerate(rows):
        toks = new_tokens[i][: accepted[i] + 1][: remaining[i]]
        for j, t in enumerate(toks):
            if t in stops:
                toks = toks[: j + 1]
                break
        out[r].extend(toks)
        agg.requests[r].record_round(len(toks), g, accepted[i])
        produced.append(len(toks))
    return produced


def _finished_rows(out, rows, stops, max_new_tokens, agg) -> set[int]:
    done = set()
    for i, r in enumerate(rows):
        m = agg.requests[r]
        m.new_tokens = len(out[r])
        if out[r] and out[r][-1] in stops:
            m.stop_reason = "stop"
            done.add(i)
        elif len(out[r]) >= max_new_tokens:
            done.add(i)
    return done
