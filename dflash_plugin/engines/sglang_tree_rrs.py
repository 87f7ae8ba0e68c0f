"""DFLASH_TREE at T > 0 by recursive rejection sampling (`DFLASH_TREE_RRS=1`, with
`DFLASH_TREE_FAST_ACCEPT=1`; no SGLang import here).

SGLang's tree acceptance at T > 0 (`tree_speculative_sampling_target_only`), and the fast
acceptance's walk by one target sample per node, keep a child only when the target's sample is
its token: with the target's probability of that token. Recursive rejection sampling keeps it
with probability min(1, r(x) / s(x)) against the drafter's proposal s, which is much higher
where the drafter is close to the target. On the CPU reference at T = 1 (BENCHMARKS.md, "Tree
drafting") it lifts tau from 2.05 to 2.40 at 32 nodes, top-4 (1.17x). It needs two things the
greedy tree has not:
- the siblings at each depth are a sample without replacement from the drafter's q at the
  request's temperature (`sampled_topk`: the tree's shape from q's sorted values, its tokens
  from `tree.sample_ranks`), and q is kept for the walk (`SampledTreeStage`: the tree phase's
  graph, with the temperatures as an input);
- the walk (`rrs_round`: `specdec_kernels.tree_rejection`, one program per request, or its
  torch spec `reference.tree_rejection`) runs in the acceptance's graph (`RejectionStage`, an
  `AcceptStage` whose inputs are the verify's logits, the temperatures and q); the KV move and
  the drafter append follow as for the greedy walk.
Every emitted token follows the target's distribution given the tokens before it
(`tests/dflash/test_tree_race.py` checks that by a chi-square test).

A round takes it when the fast acceptance takes it (`sglang_tree_verify.round_slow_reason`),
no request is greedy (a greedy row would need the top-K tree) and the batch has at most
`MAX_BS` requests: the stage's buffers hold the logits of every tree node, `[bs, W, vocab]`
fp32 (Qwen3-8B, 32 nodes, 8 requests: 160 MB) and q, `[bs, D, vocab]`. Other T > 0 rounds
walk by samples. `=check` does not cover these rounds (SGLang has no such walk to compare).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from specdec_kernels import reference

from ..errors import ConfigError, env_flag
from ..tree import sample_ranks
from .sglang_tree_accept import AcceptStage
from .sglang_tree_append import fused_workspaces
from .sglang_tree_input import TreeVerifyTensors
from .sglang_tree_stage import TreeStage, first_rows
from .sglang_tree_tp import head_logits, head_rows

ENV = "DFLASH_TREE_RRS"
MAX_BS = 8  # requests per round at most (the stages' buffers: see above)


def rrs_from_env(environ=os.environ) -> bool:
    """`DFLASH_TREE_RRS`: 0 (default) or 1; a clear error otherwise."""
    return env_flag(environ, ENV, "0", "T > 0 rounds by recursive rejection sampling, with "
                                       "DFLASH_TREE_FAST_ACCEPT=1")


def takes(info, bs: int) -> bool:
    """Whether a T > 0 round that the fast acceptance takes can walk by rejection sampling."""
    return bs <= MAX_BS and not info.is_all_greedy and not info.is_any_greedy


def sampled_topk(hidden: torch.Tensor,  # [bs, D, h] the drafter's hidden states
                 lm_head, k: int,
                 temps: torch.Tensor,  # [bs, 1] the requests' temperatures (> 0)
                 generator: torch.Generator | None = None):
    """(shape log-probs [bs, D, k]: q's k largest, sorted; tokens [bs, D, k]: a sample of k
    without replacement from q, in draw order; q [bs, D, V] fp32) with q = softmax(logits / T)
    of the target's LM head over the drafter's hidden states."""
    logits, start = head_logits(hidden, lm_head)
    q = torch.softmax(logits / temps.view(-1, 1, 1), -1)
    ids = sample_ranks(q, k, generator)
    return q.topk(k, dim=-1).values.clamp_min(1e-30).log(), (ids + start) if start else ids, q


class SampledTreeStage(TreeStage):
    """`run(hidden, bonus, seq_lens, temps)` -> (`TreeVerifyTensors` without the mask, q `[bs,
    D, V]`); `topk_fn(hidden, temps)` is `sampled_topk` with the head bound."""

    def warm(self, max_bs: int, hidden_size: int, dtype: torch.dtype) -> list[int]:
        return super().warm(min(max_bs, MAX_BS), hidden_size, dtype)

    def run(self, hidden, bonus, seq_lens, temps=None):
        bs = int(hidden.shape[0])
        if temps is None:  # warm-up rows
            temps = torch.ones(bs, 1, device=hidden.device)
        pad, (h, b, lens, tm) = self.graphs.load((hidden, bonus, seq_lens, temps.float()))

        def phase() -> None:
            top_lp, top_ids, q = self.topk_fn(h, tm)
            self.outputs[pad] = (self.tree(top_lp, top_ids, b, lens), q)

        self.graphs.run(pad, phase)
        t, q = self.outputs[pad]
        return first_rows(t, bs), q[:bs]


def rrs_round(logits: torch.Tensor,  # [b, W, V] the verify's logits at every tree index
              temps: torch.Tensor,  # [b, 1] temperatures
              q: torch.Tensor,  # [b, D, V] the drafter's probabilities (the siblings' proposal)
              draft, parents, loc, live,  # [b, W] long x 3, [b] bool
              topk: int, triton: bool = False):
    """The walk by recursive rejection sampling and `accept_round`'s outputs from it."""
    b, d = q.shape[0], q.shape[1]
    p = torch.softmax(logits.float() / temps.view(-1, 1, 1), -1)
    u = torch.rand(b, d, topk, device=p.device)
    u_bonus = torch.rand(b, device=p.device)
    if triton:
        from specdec_kernels.tree_rejection import tree_rejection

        path, accepted, bonus = tree_rejection(p, q, draft, parents, u, u_bonus)
    else:
        path, accepted, bonus = reference.tree_rejection(p, q, draft, parents, u, u_bonus)
    nxt = F.pad(draft.gather(1, path[:, 1:]), (0, 1))  # [b, D + 1] the path's tokens
    at = torch.arange(d + 1, device=p.device)
    tok = torch.where(at == accepted[:, None], bonus[:, None], nxt)
    return reference.path_outputs(tok, path, accepted, loc, live)


class RejectionStage(AcceptStage):
    """`run(logits, temps, q, t, loc, hidden, prefix)` -> `Accepted`: `AcceptStage` with the
    walk by recursive rejection sampling (`rrs_round`); `vocab` V, `topk` K."""

    def __init__(self, *args, vocab: int, topk: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.vocab, self.topk = vocab, topk

    def warm(self, max_bs: int, hidden_size: int, dtype: torch.dtype) -> list[int]:
        return super().warm(min(max_bs, MAX_BS), hidden_size, dtype)

    def dead_inputs(self, pad: int) -> tuple[torch.Tensor, ...]:
        dev, v = self.device, self.vocab
        return (torch.zeros(pad, self.width, v, device=dev), torch.ones(pad, 1, device=dev),
                torch.zeros(pad, self.depth, v, device=dev))

    def walk(self, inputs, draft, parents, depths, loc, live):
        logits, temps, q = inputs
        return rrs_round(logits, temps, q, draft, parents, loc, live, self.topk, self.triton)

    def run(self, logits: torch.Tensor,  # [bs * W, V] the verify's logits
            temps: torch.Tensor,  # [bs, 1]
            q: torch.Tensor,  # [bs, D, V] the round's (`SampledTreeStage`)
            t: TreeVerifyTensors, loc, hidden, prefix):
        bs = int(prefix.shape[0])
        inputs = (logits.view(bs, self.width, -1).float(), temps.float(), q.float())
        return self.accept(inputs, t, loc, hidden, prefix)


def stages(device: torch.device, plan, head, vocab_size: int, move_fn, append_fn, *,
           graphs: bool, triton: bool, keep=None):
    """(SampledTreeStage, RejectionStage) for a DFLASH_TREE worker (`plan`: its TreePlan, `head`
    the LM head its trees read), or None with the reason when the head's vocabulary is not the
    model's (the verify's logits would not line up with q)."""
    rows = head_rows(head)[1]
    if rows != int(vocab_size):
        return None, f"the LM head has {rows} vocab rows, the model {int(vocab_size)}"
    tree = SampledTreeStage(device, lambda h, t: sampled_topk(h, head, plan.topk, t),
                            plan.budget, plan.depth, graphs, triton)
    accept = RejectionStage(device, move_fn, append_fn, plan.width, plan.depth, graphs,
                            keep=keep, triton=triton, vocab=int(vocab_size), topk=plan.topk)
    return (tree, accept), None


def rrs_stages(worker, device, graphs: bool, kernels: bool):
    """`stages` for a DFLASH_TREE worker when `DFLASH_TREE_RRS=1` ((None, None)
    when it is 0; (None, why) when T > 0 rounds cannot take the fast acceptance here)."""
    if not rrs_from_env():
        return None, None
    if not worker._fast_accept:
        raise ConfigError("DFLASH_TREE_RRS", "=1 needs DFLASH_TREE_FAST_ACCEPT=1 (the walk runs "
                                             "in the fast acceptance's graph)")
    if not worker._fast_sampling:
        return None, "T > 0 rounds take SGLang's acceptance on this server"
    return stages(device, worker.plan, worker._head,
                  worker.target_worker.model_runner.model_config.vocab_size,
                  worker.accept_stage.move_fn, worker.accept_stage.append_fn, graphs=graphs,
                  triton=kernels, keep=lambda: fused_workspaces(worker))
