"""Tree rounds (DDTree-style) in the fast runtime, over a `FastDecoder`'s state and caches.

A round is three steps with static shapes and no host sync: `draft` (the drafter's top-k per
depth, then `tree_build.build_tree`: n nodes per row), `verify` (the target once over
[anchor + n nodes] under the ancestor mask, then the walk and the *compaction*) and
`accept` (`accept.accept_round` along the walked path: caps, stop tokens, lengths, history).
*Scratch slots*: the block's K/V go to slots length + tree index (tree nodes share positions:
RoPE uses position length + depth); the compaction moves the accepted path to slots
length + depth in every target layer and writes the drafter's context K/V of the path at
those positions. Shapes: g = min(B - 1, remaining), n = min(budget, capacity(g, topk)), as in the
reference `tree_generate`, so both commit the same tokens in the same rounds (greedy).
Sampled (T > 0), as the reference: the shape from the drafter's transformed q, tokens a sample
without replacement from q per depth (`tree.sample_ranks`), the walk recursive rejection
sampling (`tree_build.rejection_path`). Random numbers come from `generator` (CPU) or the
device's default generator (CUDA, safe under graph capture: seed it with `torch.manual_seed`).
"""

from __future__ import annotations

import time

import torch

from ..errors import require
from ..metrics import AggregateMetrics, GenerationResult, RequestMetrics
from ..sampling import SamplingParams
from ..tree import capacity, sampled_drafts
from .accept import _accept_impl
from .attention import plan
from .drafter import context_write, draft_logits
from .graphs import StepGraphs
from .loop import AHEAD_CAP, FastDecoder, _event, _sync, finish, rounds_ahead
from .qwen3 import target_forward
from .tree_build import ancestor_mask, build_tree, greedy_path, rejection_path


class TreeDecoder:
    """Tree rounds of `budget` nodes, top-`topk` per depth, blocks of `block_size` (anchor +
    g <= block_size - 1 depths) over `dec`. `draft_logits(g) -> [batch, g, vocab]` replaces the
    DFlash drafter (tests: oracles; it must not sync with the host). `params`: greedy, or the
    sampling transform of every request."""

    def __init__(self, dec: FastDecoder, budget: int, topk: int = 4,
                 block_size: int | None = None, draft_logits=None,
                 params: SamplingParams = SamplingParams()):
        vocab = dec.target.shape.vocab
        block = block_size or dec.max_block
        require(budget >= 1, "tree_budget", f"must be >= 1 (0 = linear drafting), got {budget}")
        require(1 <= topk <= vocab, "tree_topk", f"must be in [1, {vocab}], got {topk}")
        require(2 <= block <= dec.max_block, "block_size",
                f"must be in [2, {dec.max_block}] for tree rounds, got {block}")
        require(dec.drafter is not None or draft_logits is not None, "proposer",
                "tree rounds need a drafter (or a draft_logits hook)")
        self.dec, self.budget, self.topk, self.block = dec, budget, topk, block
        self.draft_hook, self.params = draft_logits, params
        self.generator = None  # CUDA: the default generator (graph-safe)
        if dec.device.type != "cuda":
            self.generator = torch.Generator(dec.device)
            self.generator.manual_seed(params.seed if params.seed is not None else 0)
        n, d = self.nodes(block - 1), self.depth(block - 1)
        b, dev = dec.batch, dec.device
        z = dict(dtype=torch.long, device=dev)
        self.tokens = torch.zeros(b, n + 1, **z)  # tree index 0: the anchor's slot (unused)
        self.parents = torch.zeros(b, n + 1, **z)
        self.depths = torch.zeros(b, n + 1, **z)
        self.tgt_path = torch.zeros(b, d + 1, **z)  # the target's ids along the walked path
        self.drf_path = torch.zeros(b, d, **z)  # the path's draft ids, -1 past its end
        if not params.greedy:  # the drafter's q per depth, read by the sampled walk
            self.q = torch.zeros(b, block - 1, vocab, dtype=torch.float32, device=dev)
        self.steps = StepGraphs(dev, dec.steps.enabled)

    def nodes(self, g: int) -> int:
        return min(self.budget, capacity(g, self.topk))

    def depth(self, g: int) -> int:
        return min(g, self.nodes(g))

    # ---- steps ----
    def _draft(self, g: int) -> None:
        dec, n = self.dec, self.nodes(g)
        if self.draft_hook is not None:
            logits = self.draft_hook(g).float()  # [batch, g, vocab]
        else:
            logits = draft_logits(dec.drafter, dec.dcache, dec.drope, dec.target.embed,
                                  dec.target.lm_head, dec.anchor, g + 1, dec.attention).float()
        if self.params.greedy:
            lp, ids = logits.log_softmax(-1).topk(self.topk, dim=-1)  # [batch, g, k]
        else:  # shape from q's sorted values, tokens drawn from q
            q, shape_lp, ids = sampled_drafts(logits, self.params, self.topk, self.generator)
            self.q[:, :g].copy_(q)
            lp = shape_lp.topk(self.topk, dim=-1).values
        tok, par, dep = build_tree(lp, ids, n)
        self.tokens[:, 1:n + 1].copy_(tok)
        self.parents[:, 1:n + 1].copy_(par)
        self.depths[:, 1:n + 1].copy_(dep)

    def _verify(self, g: int) -> None:
        """Target forward, walk, compaction of the path (idempotent: it re-reads only the
        scratch slots this step writes, so a graph's eager warm-up may run it twice; sampled, a
        warm-up draws other random numbers, which only the capture's replays use)."""
        dec, n, d = self.dec, self.nodes(g), self.depth(g)
        lengths, s = dec.tcache.lengths, dec.target.shape
        ids = torch.cat([dec.anchor[:, None], self.tokens[:, 1:n + 1]], 1)  # [batch, n + 1]
        parents, depths = self.parents[:, :n + 1], self.depths[:, :n + 1]
        slots = lengths[:, None] + torch.arange(n + 1, device=dec.device)
        attn = plan(dec.attention, lengths[:, None], dec.tcache.slots, s.heads // s.kv_heads,
                    block_mask=ancestor_mask(parents, d))
        hn, feats = target_forward(dec.target, dec.tcache, dec.trope, ids,
                                   lengths[:, None] + depths, None, dec.layer_ids,
                                   ops=dec.ops, slots=slots, attn=attn)
        logits = dec.linear(hn, dec.target.lm_head)  # [batch, n + 1, vocab]
        j = torch.arange(d + 1, device=dec.device)
        if self.params.greedy:
            choice = logits.argmax(-1)  # [batch, n + 1]
            path, acc = greedy_path(ids, parents, depths, choice, d)  # [batch, d + 1], [batch]
            self.tgt_path[:, :d + 1].copy_(choice.gather(1, path))
            on_path = ids.gather(1, path[:, 1:])  # [batch, d] the path's draft tokens
        else:  # the path's tokens, then the bonus at `acc` (and past it: `accept` stops there)
            path, acc, bonus = rejection_path(ids, parents, logits, self.q[:, :d], self.params,
                                              d, self.topk, self.generator)
            on_path = ids.gather(1, path[:, 1:])
            self.tgt_path[:, :d + 1].copy_(torch.where(
                j < acc[:, None], torch.cat([on_path, bonus[:, None]], 1), bonus[:, None]))
        self.drf_path[:, :d].copy_(torch.where(j[:d] < acc[:, None], on_path, -1))
        src, dst = slots.gather(1, path), slots[:, :d + 1]
        for kv in (dec.tcache.k, dec.tcache.v):  # [layers, batch, kv_heads, max_len, head_dim]
            L, b, h, _, hd = kv.shape
            vals = kv.gather(3, src[None, :, None, :, None].expand(L, b, h, d + 1, hd))
            kv.scatter_(3, dst[None, :, None, :, None].expand(L, b, h, d + 1, hd), vals)
        if dec.drafter is not None:
            pf = feats.gather(1, path[:, :, None].expand(-1, -1, feats.shape[-1]))
            context_write(dec.drafter, dec.dcache, dec.drope, pf, dst)

    def _accept(self, g: int) -> None:
        d, dec = self.depth(g), self.dec
        _accept_impl["fn"](self.tgt_path[:, :d + 1], self.drf_path[:, :d], dec.stops,
                           dec.max_new, dec.out_buf, dec.out_len, dec.anchor, dec.tcache.lengths,
                           dec.done, dec.history, dec.round_idx)

    def round(self, g: int, events=None) -> None:
        key = (self.budget, self.topk, g)
        if events is not None:
            events[0].record()
        self.steps.run(("tree-draft", *key), lambda: self._draft(g))
        if events is not None:
            events[1].record()
        self.steps.run(("tree-verify", *key), lambda: self._verify(g))
        if events is not None:
            events[2].record()
        self.steps.run(("tree-accept", *key), lambda: self._accept(g),
                       restore=self.dec._state())
        if events is not None:
            events[3].record()

    @torch.inference_mode()
    def warmup(self, widths: list[int] | None = None) -> float:
        """Every prefill width (as `FastDecoder.warmup`) and one tree round per depth
        g = 1..block_size - 1: compiles and CUDA graphs before the first request."""
        t0 = time.perf_counter()
        dec = self.dec
        widths = dec.prefill_widths() if widths is None else list(widths)
        top = dec.max_len - dec.max_block - 1
        for w in widths or [1]:
            dec.prefill([[0] * min(w, top)], 1)
        dec.prefill([[0]], 1)  # round shapes do not depend on lengths: keep the scratch in range
        for g in range(1, self.block):
            self.round(g)
        _sync(dec.device)
        return time.perf_counter() - t0


@torch.inference_mode()
def tree_generate_fast(dec: FastDecoder | TreeDecoder, prompts: list[list[int]], *,
                       budget: int | None = None, topk: int = 4, block_size: int | None = None,
                       max_new_tokens: int, stop_token_ids=(),
                       params: SamplingParams | None = None,
                       profile: bool = False) -> GenerationResult:
    """Tree decoding, greedy or sampled (`params`); `dec` is a `TreeDecoder` (reused: its graphs
    stay captured; `params` must then be its own or None) or a `FastDecoder` with `budget` /
    `topk` / `block_size` (a new TreeDecoder per call). Metrics as `fast_generate`, plus
    `metrics.tree` as the reference `tree_generate` reports it (build time is inside the draft
    step: `draft_seconds` when profiled)."""
    if isinstance(dec, TreeDecoder):
        tdec = dec
        require(params is None or params == tdec.params, "params",
                f"this TreeDecoder samples with {tdec.params}; got {params}")
    else:
        tdec = TreeDecoder(dec, budget, topk, block_size, params=params or SamplingParams())
    fd, bsz = tdec.dec, tdec.block
    width = max((len(p) for p in prompts), default=0)
    need = width + max_new_tokens + tdec.nodes(bsz - 1) + 1
    require(need <= fd.max_len, "max_new_tokens",
            f"prompt ({width}) + max_new_tokens + tree nodes + 1 needs {need} slots; the "
            f"runtime was built with {fd.max_len}")
    agg = AggregateMetrics([RequestMetrics(prompt_tokens=len(p)) for p in prompts])
    agg.tree = {"nodes_verified": 0, "build_seconds": None, "accepted_depths": {}}
    t0 = time.perf_counter()
    fd.prefill(prompts, max_new_tokens, stop_token_ids, params=tdec.params,
               generator=tdec.generator)
    _sync(fd.device)
    agg.prefill_seconds = time.perf_counter() - t0
    n_req = len(prompts)
    issued: list[int] = []  # g of every issued round
    timing = []
    while True:
        done, out_len = torch.stack([fd.done.long(), fd.out_len]).tolist()  # the host read
        live = [i for i in range(n_req) if not done[i]]
        if not live:
            break
        rem = max(max_new_tokens - out_len[i] for i in live)
        g = min(bsz - 1, rem)
        ahead = rounds_ahead(rem, bsz)
        for _ in range(min(ahead, AHEAD_CAP)):
            ev = [_event(fd.device) for _ in range(4)] if profile else None
            tdec.round(g, ev)
            issued.append(g)
            if ev:
                timing.append(ev)
    depths = agg.tree["accepted_depths"]

    def on_round(r: int, _row: int, acc: int) -> None:
        depths[acc] = depths.get(acc, 0) + 1
        agg.tree["nodes_verified"] += tdec.nodes(issued[r])
    return finish(fd, agg, issued, stop_token_ids, timing, t0, verify_end=3,
                  on_round=on_round)[0]
