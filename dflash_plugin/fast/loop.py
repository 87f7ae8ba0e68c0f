"""Greedy decoding loops of the fast runtime: DFlash rounds, host-drafted (n-gram) rounds, and
plain autoregressive decoding (a round with block length 1), all over static caches.

A *round* is three steps over persistent device state: `draft` (q - 1 draft ids), `verify` (the
target on `[anchor, drafts]`, plus the drafter's context write) and `accept`
(`accept.accept_round`: greedy acceptance, caps, stop tokens, output buffer, lengths, per-round
metrics). No step syncs with the host; the
host reads the state only when it must choose the next block length, so at most one read per
round and usually one per several rounds. Ragged rows are handled by per-row lengths and masks;
finished rows stay in the batch and commit nothing.

*Shapes*: a step's compiled kernels and CUDA graph are keyed by its block length q (1..max_block)
and the prefill's by the padded prompt width: prompts are right-padded to a multiple of
`prefill_bucket` (padded positions lie past every row's length: causal queries of real tokens
never see them, and their cache slots are stale until overwritten), so `warmup` can pay every
compile and capture before the first request. *Invariant* decoders compute a position the same
way whatever the number of queries in its forward (batch-invariant matmuls, RMSNorm and
attention plan: `invariant_ops`, "triton-invariant"). *Adaptive* generation picks each round's
block length from measured round times and the acceptance seen so far (`adaptive_loop`, imported
only when a generation is adaptive); switching q costs no capture, `warmup` has captured every q.
"""

from __future__ import annotations

import os
import time
from functools import partial

import torch
from specdec_kernels.qwen3 import EAGER, Ops, add_norm, norm_rope
from torch.nn import functional as F

from ..adaptive import AdaptiveConfig
from ..errors import ConfigError, require
from ..metrics import AggregateMetrics, GenerationResult, RequestMetrics
from ..ngram import ngram_lookup
from ..sampling import SamplingParams, pick_tokens
from .accept import MAX_STOPS, _accept_impl
from .attention import check_backend, resolve_backend
from .cache import StaticKVCache, rope_table
from .drafter import DraftWeights, context_write, draft_block
from .graphs import StepGraphs, _event, _sync
from .qwen3 import TargetWeights, target_forward

AHEAD_CAP = 32  # rounds issued without reading the state back
GREEDY = SamplingParams()


def rounds_ahead(rem: int, block: int) -> int:
    """Rounds of `block` tokens that can be issued before the next host read when the longest
    live row needs `rem` more: a round commits at most `block`, so full blocks while at least one
    more stays needed (plain steps: all `rem`); a shorter last block is issued alone."""
    if block == 1:
        return rem
    return (rem - (block - 1)) // block + 1 if rem >= block - 1 else 1


class FastDecoder:
    def __init__(self, target: TargetWeights, drafter: DraftWeights | None, batch: int,
                 max_len: int, device, max_block: int = 16, graphs: bool = True,
                 attention: str = "auto", fuse_round: bool = False, prefill_bucket: int = 64,
                 invariant: bool = False):
        device = torch.device(device)
        self.fuse_round = fuse_round  # one graph per round (draft + verify + accept) if unprofiled
        require(prefill_bucket >= 0, "prefill_bucket",
                f"must be >= 0 (0 = no padding of prompt widths), got {prefill_bucket}")
        self.prefill_bucket = prefill_bucket
        attention = resolve_backend(attention, device)
        if invariant and attention == "triton":
            attention = "triton-invariant"
        check_backend(attention, device)
        self.attention = attention  # decode/verify/draft steps; prefill always uses SDPA
        self.invariant = invariant
        # the target's layers (None: the default ops, compiled pointwise after compile_steps)
        # and its LM head
        self.ops = invariant_ops(device) if invariant else None
        self.linear = self.ops.linear if invariant else F.linear
        s = target.shape
        max_len = -(-max_len // 64) * 64  # aligned slots for the fused attention kernels
        dtype = target.embed.dtype
        self.target, self.drafter, self.device = target, drafter, device
        self.batch, self.max_len, self.max_block = batch, max_len, max_block
        self.tcache = StaticKVCache(s.layers, batch, s.kv_heads, max_len, s.head_dim, dtype,
                                    device)
        self.trope = rope_table(max_len, s.head_dim, s.theta, dtype, device)
        self.layer_ids = drafter.layer_ids if drafter is not None else ()
        if drafter is not None:
            d = drafter.shape
            self.dcache = StaticKVCache(d.layers, batch, d.kv_heads, max_len, d.head_dim,
                                        drafter.fc.dtype, device)
            self.dcache.lengths = self.tcache.lengths  # one committed length per row
            self.drope = rope_table(max_len, d.head_dim, d.theta, drafter.fc.dtype, device)
        z = dict(dtype=torch.long, device=device)
        self.anchor = torch.zeros(batch, **z)
        self.draft_ids = torch.zeros(batch, max(max_block - 1, 1), **z)
        self.target_ids = torch.zeros(batch, max_block, **z)
        self.out_len = torch.zeros(batch, **z)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.max_new = torch.zeros((), **z)
        self.stops = torch.full((MAX_STOPS,), -1, **z)
        self.round_idx = torch.zeros(1, **z)
        # allocated once: captured graphs keep the addresses of every tensor they touch
        self.out_buf = torch.zeros(batch, max_len + 1, **z)  # last column: dump slot
        self.history = torch.zeros(max_len + 2, 3, batch, **z)  # per round: n, accepted, live
        self.steps = StepGraphs(device, graphs)
        self.round_ms: dict[int, float] = {}  # q -> ms of one round (`adaptive_loop`)

    # ---- steps (static shapes for a given q; no host sync) ----
    def _draft(self, q: int) -> None:
        ids = draft_block(self.drafter, self.dcache, self.drope, self.target.embed,
                          self.target.lm_head, self.anchor, q, self.attention)
        self.draft_ids[:, :q - 1].copy_(ids)

    def _verify(self, q: int, ctx: bool = True) -> None:
        block = torch.cat([self.anchor[:, None], self.draft_ids[:, :q - 1]], dim=1)
        positions = self.tcache.lengths[:, None] + torch.arange(q, device=self.device)
        hn, feats = target_forward(self.target, self.tcache, self.trope, block, positions,
                                   positions + 1, self.layer_ids, self.attention, self.ops)
        self.target_ids[:, :q].copy_(self.linear(hn, self.target.lm_head).argmax(-1))
        if self.drafter is not None and ctx:
            context_write(self.drafter, self.dcache, self.drope, feats, positions)

    def accept_args(self, q: int) -> tuple:
        """The arguments of `accept_round` for a block of q tokens (persistent tensors)."""
        return (self.target_ids[:, :q], self.draft_ids[:, :q - 1], self.stops, self.max_new,
                self.out_buf, self.out_len, self.anchor, self.tcache.lengths, self.done,
                self.history, self.round_idx)

    def _accept(self, q: int) -> None:
        _accept_impl["fn"](*self.accept_args(q))

    def _state(self):
        return [self.out_buf, self.out_len, self.anchor, self.tcache.lengths, self.done,
                self.history, self.round_idx]

    # ---- prefill ----
    def prefill(self, prompts: list[list[int]], max_new_tokens: int, stops=(),
                params: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> None:
        """The prompts' K/V and each row's first token: the target's argmax, or a sample with
        `params` (sampled tree rounds, `tree_loop`)."""
        b, dev = self.batch, self.device
        require(1 <= len(prompts) <= b, "prompts", f"1..{b} prompts per call, got {len(prompts)}")
        require(len(stops) <= MAX_STOPS, "stop_token_ids", f"at most {MAX_STOPS}")
        rows = prompts + [prompts[0]] * (b - len(prompts))  # padding rows start finished
        width = max(len(p) for p in rows)
        need = width + max_new_tokens + self.max_block
        require(need <= self.max_len, "max_new_tokens",
                f"prompt ({width}) + max_new_tokens + block needs {need} slots; the runtime "
                f"was built with {self.max_len}")
        width = self.padded_width(width)
        ids = torch.zeros(b, width, dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, :len(p)] = torch.tensor(p)
        ids = ids.to(dev)
        lens = torch.tensor([len(p) for p in rows], device=dev)
        pos = torch.arange(width, device=dev)[None].expand(b, width)
        hn, feats = target_forward(self.target, self.tcache, self.trope, ids, pos, pos + 1,
                                   self.layer_ids, ops=self.ops)  # SDPA, not graphed
        last = hn.gather(1, (lens - 1)[:, None, None].expand(b, 1, hn.shape[-1]))[:, 0]
        first = pick_tokens(self.linear(last, self.target.lm_head), params or GREEDY, generator)
        if self.drafter is not None:
            context_write(self.drafter, self.dcache, self.drope, feats, pos)
        self.tcache.reset(lens)
        self.anchor.copy_(first)
        self.out_buf.zero_()
        self.out_buf[:, 0] = first
        self.out_len.fill_(1)
        self.max_new.fill_(max_new_tokens)
        self.stops.fill_(-1)
        if stops:
            self.stops[:len(stops)] = torch.tensor(list(stops), device=dev)
        pad = torch.arange(b, device=dev) >= len(prompts)
        hit = (first[:, None] == self.stops).any(-1)
        self.done.copy_(pad | hit | (self.out_len >= self.max_new))
        self.history.zero_()
        self.round_idx.zero_()

    def padded_width(self, width: int) -> int:
        """The prefill width of a batch whose longest prompt has `width` tokens."""
        if not self.prefill_bucket:
            return width
        return min(-(-width // self.prefill_bucket) * self.prefill_bucket, self.max_len)

    def prefill_widths(self) -> list[int]:
        """Every padded width a prefill can have (with bucketing; [] without)."""
        if not self.prefill_bucket:
            return []
        top = self.max_len - self.max_block - 1  # the longest prompt that fits (1 new token)
        return sorted({self.padded_width(w) for w in range(1, top + 1)})

    @torch.inference_mode()
    def warmup(self, widths: list[int] | None = None) -> float:
        """Pay every compile and capture before the first request (a server calls it once at
        start): a prefill at each padded width (`prefill_widths`; or the prompt widths given)
        and one round at each block length 1..max_block (drafter rounds with a drafter, host
        drafts without one or with fused rounds): Triton and inductor compiles, dynamo's shape
        specialisations, CUDA graphs. Outputs are unchanged (a prefill resets all state).
        Returns seconds spent."""
        t0 = time.perf_counter()
        widths = self.prefill_widths() if widths is None else list(widths)
        top = self.max_len - self.max_block - 1
        for w in widths or [1]:
            self.prefill([[0] * min(w, top)], 1)  # the padded width of min(w, top) is w
        for q in range(1, self.max_block + 1):
            if self.drafter is not None or q == 1:
                self.round(q)
            if q > 1 and (self.drafter is None or self.fuse_round):
                self.round(q, [[0] * (q - 1)] * self.batch)
        if self.drafter is not None:
            self.round(1, ctx=False)  # adaptive plain rounds
        _sync(self.device)
        return time.perf_counter() - t0

    # ---- one round ----
    def _round_steps(self, q: int, ctx: bool = True, drafted: int | None = None) -> None:
        if q > 1:
            self._draft(max(q, drafted or q))
        self._verify(q, ctx)
        self._accept(q)

    def round(self, q: int, host_draft: list[list[int]] | None = None, events=None,
              ctx: bool = True, drafted: int | None = None) -> None:
        """One round of block length q; `ctx=False` skips the drafter's context write (adaptive
        plain rounds: a plain step's cost; later drafts see those positions' stale slots).
        `drafted`: the drafter runs a block of this length (>= q) and the target verifies its
        first q - 1 drafts (the adaptive policy: a DFlash drafter trained on blocks of B drafts
        worse in shorter blocks, so its drafts, and their acceptance, stay those of length B)."""
        tag = () if ctx else ("no-ctx",)
        dl = max(q, drafted or q)
        if self.fuse_round and events is None and host_draft is None:
            self.steps.run(("round", q, dl, *tag), lambda: self._round_steps(q, ctx, dl),
                           restore=self._state())
            return
        if events is not None:
            events[0].record()
        if q > 1 and host_draft is not None:
            self.draft_ids[:, :q - 1].copy_(torch.tensor(host_draft), non_blocking=True)
        elif q > 1:
            self.steps.run(("draft", dl), lambda: self._draft(dl))
        if events is not None:
            events[1].record()
        self.steps.run(("verify", q, *tag), lambda: self._verify(q, ctx))
        if events is not None:
            events[2].record()
        self.steps.run(("accept", q), lambda: self._accept(q), restore=self._state())
        if events is not None:
            events[3].record()


def invariant_ops(device: torch.device) -> Ops:
    """The ops of an invariant decoder's target layers and LM head: the batch-invariant matmul
    and RMSNorm (`specdec_kernels.matmul` / `norm`: Triton, so CUDA or the interpreter on CPU);
    RoPE, SwiGLU and the residual adds are elementwise, so row-wise already. Not compiled:
    inductor picks a reduction layout per shape."""
    require(device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1", "invariant",
            f"needs a CUDA device (or TRITON_INTERPRET=1 on CPU) for its Triton kernels, got "
            f"{device}")
    try:
        from specdec_kernels.matmul import invariant_linear
        from specdec_kernels.norm import invariant_rms_norm
    except ImportError as err:
        raise ConfigError("invariant", f"needs Triton and `specdec_kernels`: {err}") from None
    return Ops(linear=invariant_linear, rms_norm=invariant_rms_norm,
               norm_rope=partial(norm_rope, norm=invariant_rms_norm),
               add_norm=partial(add_norm, norm=invariant_rms_norm), swiglu=EAGER.swiglu)


@torch.inference_mode()
def fast_generate(dec: FastDecoder, prompts: list[list[int]], *, block_size: int,
                  max_new_tokens: int, stop_token_ids=(), proposer: str = "dflash",
                  profile: bool = False, adaptive: AdaptiveConfig | bool | None = None
                  ) -> GenerationResult:
    """Greedy generation; `proposer` is "dflash", "ngram" (host prompt lookup) or "ar"
    (plain decoding: block_size is forced to 1).

    `adaptive` (DFlash only; True = `AdaptiveConfig()`): each round's block length, one q <=
    block_size for the whole batch, is chosen at the host reads from the measured round times
    and the batch's acceptance (`adaptive_loop.AdaptiveRounds`). Rounds per chosen q:
    `metrics.block_lengths`. Outputs are those of plain decoding whatever the choices."""
    require(proposer in ("dflash", "ngram", "ar"), "proposer", f"got {proposer!r}")
    require(proposer != "dflash" or dec.drafter is not None, "proposer", "no drafter loaded")
    bsz = 1 if proposer == "ar" else block_size
    require(1 <= bsz <= dec.max_block, "block_size", f"must be in [1, {dec.max_block}]")
    ada = None
    if adaptive is not None and adaptive is not False:
        from .adaptive_loop import AdaptiveRounds  # it builds on this module

        ada = AdaptiveRounds(dec, adaptive, proposer, bsz)
    dev = dec.device
    agg = AggregateMetrics([RequestMetrics(prompt_tokens=len(p)) for p in prompts])
    t0 = time.perf_counter()
    dec.prefill(prompts, max_new_tokens, stop_token_ids)
    _sync(dev)
    agg.prefill_seconds = time.perf_counter() - t0
    n_req = len(prompts)
    issued: list[int] = []  # g of every issued round
    timing = []
    while True:
        if ada is None:
            done, out_len = torch.stack([dec.done.long(), dec.out_len]).tolist()  # the host read
        else:  # the same one read, plus the rounds since the last one for the policy
            done, out_len = ada.read(issued)
        live = [i for i in range(n_req) if not done[i]]
        if not live:
            break
        rem = max(max_new_tokens - out_len[i] for i in live)
        cap = AHEAD_CAP
        if ada is not None:
            bsz, most = ada.policy.choose()
            cap = min(cap, most)
        g = min(bsz - 1, rem)
        ahead = rounds_ahead(rem, bsz)
        host = None
        if proposer == "ngram":
            ahead = 1
            buf = dec.out_buf.tolist()
            host = [ngram_lookup(list(p) + buf[i][:out_len[i]], g) if i < n_req else []
                    for i, p in enumerate(prompts + [[0]] * (dec.batch - n_req))]
            last = [buf[i][out_len[i] - 1] for i in range(n_req)] + [0] * (dec.batch - n_req)
            host = [c + [c[-1] if c else a] * (g - len(c)) for c, a in zip(host, last)]
        how = {} if ada is None else ada.round_args(g)  # ctx, drafted
        for _ in range(max(1, min(ahead, cap))):
            ev = [_event(dev) for _ in range(4)] if profile else None
            dec.round(g + 1, host, ev, **how)
            issued.append(g)
            if ev:
                timing.append(ev)
    result, rounds = finish(dec, agg, issued, stop_token_ids, timing, t0)
    if ada is not None:
        agg.block_lengths = ada.block_lengths(issued[:rounds])
    return result


def finish(dec: FastDecoder, agg: AggregateMetrics, issued: list[int], stop_token_ids, timing,
           t0: float, verify_end: int = 2, on_round=None) -> tuple[GenerationResult, int]:
    """The host side of a finished generation (one read of the decoder's state): per-round
    metrics from its history (`on_round(round, row, accepted)` too, if given), each request's
    tokens and stop reason, the profiled draft / verify seconds (verify: events 1 to
    `verify_end`). Returns the result and the number of recorded rounds."""
    agg.total_seconds = time.perf_counter() - t0
    n_req = len(agg.requests)
    hist = dec.history[: int(dec.round_idx)].tolist()
    buf, out_len = dec.out_buf.tolist(), dec.out_len.tolist()
    for r, (n, acc, live) in enumerate(hist):
        for i in range(n_req):
            if live[i]:
                agg.requests[i].record_round(n[i], issued[r], acc[i])
                if on_round is not None:
                    on_round(r, i, acc[i])
    tokens = [buf[i][:out_len[i]] for i in range(n_req)]
    stops = set(stop_token_ids)
    for m, toks in zip(agg.requests, tokens):
        m.new_tokens = len(toks)
        m.stop_reason = "stop" if toks and toks[-1] in stops else "length"
    if timing:
        agg.draft_seconds = sum(e[0].elapsed_time(e[1]) for e in timing) / 1e3
        agg.verify_seconds = sum(e[1].elapsed_time(e[verify_end]) for e in timing) / 1e3
    return GenerationResult(tokens=tokens, metrics=agg), len(hist)

