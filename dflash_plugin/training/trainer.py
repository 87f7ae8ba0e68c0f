"""Training loop of the DFlash recipe.

One step: sample sequences, run the frozen target once to get context features, sample random
anchors per sequence, and train all their blocks in one drafter forward under the packed block
mask (`anchors.py`). Only the draft layers, `fc`, `hidden_norm` and `norm` train; the target's
embedding and LM head are shared and frozen. Data order and anchors depend only on (seed, step),
so a run resumed from a checkpoint continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from ..checkpoint import (
    check_compatible,
    config_for_target,
    init_drafter,
    load_drafter,
    save_drafter,
)
from ..config import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from ..layers import compile_pointwise
from ..model import DFlashDraftModel
from ..target import context_features
from .anchors import block_inputs, block_mask, loss_weights, sample_anchors
from .data import TokenDataset


def lr_scheduler(opt: torch.optim.Optimizer, warmup: int, max_steps: int, min_ratio: float,
                 step: int = 0) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up to the optimizer's lr over `warmup` steps (step s: lr * (s + 1) / warmup),
    then cosine decay to lr * `min_ratio` at `max_steps`; positioned at `step` (a resumed run or
    a re-planned horizon: the optimizer's groups hold the lr of step `step` on return)."""
    for g in opt.param_groups:  # the peak lr, whatever a previous schedule left in "lr"
        g["lr"] = g.setdefault("initial_lr", g["lr"])
    lr = opt.param_groups[0]["initial_lr"]
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=max(1, max_steps - warmup), eta_min=lr * min_ratio)
    if warmup >= 1:
        ramp = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0,
                                                 total_iters=max(1, warmup - 1))
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [ramp, cosine], milestones=[warmup])
    else:
        sched = cosine
    with warnings.catch_warnings():  # stepping to `step` before any optimizer step is intended
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(step):
            sched.step()
    return sched


class TrainConfig(BaseModel):
    """The training recipe's options (CLI `dflash train`); build with `errors.validated` for a
    `ConfigError` naming the field, its value and the allowed range."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: list[str]
    out: str
    num_layers: int = Field(1, ge=1)
    block_size: int = Field(16, ge=MIN_BLOCK_SIZE, le=MAX_BLOCK_SIZE)
    gamma: float = Field(7.0, gt=0)
    num_anchors: int = Field(64, ge=1)
    max_seq_len: int = Field(2048, ge=1)
    batch_size: int = Field(8, ge=1)  # sequences per micro-step
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(6e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(50, ge=0)
    max_steps: int = Field(1000, ge=1)
    # wall-clock budget; re-plans max_steps as it runs
    time_budget_minutes: float | None = Field(None, gt=0)
    # stop early, resumable; the schedule spans max_steps
    steps_this_run: int | None = Field(None, ge=1)
    weight_decay: float = Field(0.01, ge=0)
    clip: float = Field(1.0, gt=0)
    seed: int = 0
    save_every: int = Field(500, ge=1)
    log_every: int = Field(10, ge=1)
    mask_token_id: int | None = Field(None, ge=0)
    init_from_target: bool = False  # copy the target's top layers into the draft layers
    init_from: str | None = None  # start from an existing z-lab drafter (its config wins)
    # How all blocks of a row share one forward: "expand" gives each block its own copy of the
    # context K/V (L + B keys per block); "dense" runs every block's queries over the row's
    # context K/V once plus all block K/V, under the block mask (A*B x (L + A*B) scores).
    packed_attention: Literal["expand", "dense"] = "expand"
    # torch.compile the drafter's elementwise pieces (RMSNorm, RoPE, SiLU x up) for this run
    compile: bool = False


def copy_target_layers(drafter: DFlashDraftModel, target) -> None:
    """Initialise draft layer i from the target's layer L - n + i (same Qwen3 layer shapes)."""
    layers = target.model.layers
    n = len(drafter.layers)
    with torch.no_grad():
        for i, dl in enumerate(drafter.layers):
            src = layers[len(layers) - n + i].state_dict()
            dl.load_state_dict({k: v.float() for k, v in src.items()}, strict=False)


def block_loss(drafter, target, ids, lengths, anchors, cfg: TrainConfig, mask_id: int,
               weights: torch.Tensor):
    """Weighted block cross entropy of one micro-batch; also per-offset correct/total counts.

    Static shapes, no host sync: the target runs without its LM head (only hidden states are
    needed), and the loss covers every (anchor, offset >= 1) row with weight 0 for inactive
    anchors and positions past the sequence, instead of selecting rows with a boolean mask."""
    b, a = anchors.shape
    bs = cfg.block_size
    with torch.no_grad():
        base = getattr(target, "model", target)  # the decoder without the LM head
        hidden_states = base(input_ids=ids, output_hidden_states=True).hidden_states
        feats = context_features(hidden_states, drafter.config.target_layer_ids)
        block_ids, pos, labels, w = block_inputs(ids, lengths, anchors, bs, mask_id, weights)
        embeds = target.get_input_embeddings()(block_ids)
    if cfg.packed_attention == "dense":
        ctx_pos = torch.arange(ids.shape[1], device=ids.device)[None].expand(b, -1)
        hidden = drafter(embeds, pos, feats, ctx_pos, None,
                         attn_mask=block_mask(anchors, bs, ids.shape[1]))
    else:
        hidden = drafter.forward_packed(embeds, pos, feats, anchors)
    # Offset 0 (the clean anchor) has no label: keep offsets 1..B-1 of every block.
    rows = hidden.view(b, a, bs, -1)[:, :, 1:].reshape(b * a * (bs - 1), -1)
    labels = labels.view(b, a, bs)[:, :, 1:].reshape(-1)
    w = w.view(b, a, bs)[:, :, 1:].reshape(-1)
    logits = target.get_output_embeddings()(rows.to(embeds.dtype)).float()
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    loss = (ce * w).sum() / w.sum().clamp_min(1e-12)
    with torch.no_grad():
        keep = (w > 0).view(b * a, bs - 1)
        hit = (logits.argmax(-1) == labels).view(b * a, bs - 1) & keep
        zero = torch.zeros(1, device=ids.device)
        correct = torch.cat([zero, hit.sum(0).float()])
        total = torch.cat([zero, keep.sum(0).float()])
    return loss, correct, total


def _step_batch(ds: TokenDataset, cfg: TrainConfig, step: int, micro: int, device):
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 131 + micro)
    idx = torch.randint(0, len(ds), (cfg.batch_size,), generator=gen).tolist()
    ids, lengths, plens = ds.batch(idx, cfg.max_seq_len)
    anchors = torch.stack([sample_anchors(int(p), int(n), cfg.num_anchors, gen)
                           for p, n in zip(plens, lengths)])
    n_tokens = int(lengths.sum())
    if device.type == "cuda":  # pinned, so the copies do not wait for the queued steps
        return (*(t.pin_memory().to(device, non_blocking=True) for t in (ids, lengths, anchors)),
                n_tokens)
    return ids.to(device), lengths.to(device), anchors.to(device), n_tokens


def train(cfg: TrainConfig, target, device: str | torch.device = "cpu") -> dict:
    """Train (or resume) a drafter; returns the summary also written to `out/summary.json`."""
    compile_pointwise(cfg.compile)
    try:
        return _train(cfg, target, device)
    finally:
        compile_pointwise(False)


def _train(cfg: TrainConfig, target, device) -> dict:
    device = torch.device(device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    target.requires_grad_(False)
    ds = TokenDataset(cfg.data, min_response=cfg.block_size)
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else \
        getattr(target.config, "mask_token_id", None)
    if cfg.init_from:
        drafter = load_drafter(cfg.init_from)
        dcfg = drafter.config
        mask_id = dcfg.mask_token_id
    else:
        dcfg = config_for_target(target.config, num_layers=cfg.num_layers,
                                 block_size=cfg.block_size, mask_token_id=mask_id)
        drafter = init_drafter(dcfg, seed=cfg.seed)
    check_compatible(dcfg, target.config)
    if cfg.init_from_target:
        copy_target_layers(drafter, target)
    drafter = drafter.to(device).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay, fused=device.type == "cuda")
    state_file = out / "trainer_state.pt"
    step, max_steps, history = 0, cfg.max_steps, []
    if state_file.is_file():
        state = torch.load(state_file, map_location=device)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, max_steps, history = state["step"], state["max_steps"], state["history"]
    weights = loss_weights(cfg.block_size, cfg.gamma).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    t_start, tokens, last = time.perf_counter(), 0, {}
    bar = tqdm(total=max_steps, initial=step, desc="train", unit="step")
    run_limit = None if cfg.steps_this_run is None else step + cfg.steps_this_run
    stop_at = max_steps if run_limit is None else min(max_steps, run_limit)
    # A wall-clock budget re-plans max_steps as it goes (so such runs resume, but not exactly).
    budget_s = cfg.time_budget_minutes * 60 if cfg.time_budget_minutes else None
    mark = (time.perf_counter(), step)
    sched = lr_scheduler(opt, cfg.warmup_steps, max_steps, cfg.min_lr_ratio, step)
    pending: list[torch.Tensor] = []  # [loss, grad_norm] per step, read in one transfer
    first_step = step

    def flush():  # the loop's only host syncs: every 50 steps, at log and save points
        if pending:
            history.extend(v[0] for v in torch.stack(pending).tolist())
            pending.clear()

    while step < stop_at:
        opt.zero_grad(set_to_none=True)
        correct = total = loss_sum = 0
        for micro in range(cfg.grad_accum):
            ids, lengths, anchors, n_tokens = _step_batch(ds, cfg, step, micro, device)
            with autocast:
                loss, c, t = block_loss(drafter, target, ids, lengths, anchors, cfg,
                                        mask_id, weights)
            (loss / cfg.grad_accum).backward()
            loss_sum = loss_sum + loss.detach().float() / cfg.grad_accum
            correct, total = correct + c, total + t
            tokens += n_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.clip)
        opt.step()
        sched.step()
        step += 1
        pending.append(torch.stack([loss_sum, grad_norm.float()]))
        if budget_s is not None and step % 50 == 0:
            # Re-plan the schedule's length from the recent step time (warm-up and contention
            # make early estimates wrong); the cosine horizon converges as the budget runs out.
            flush()
            now = time.perf_counter()
            per_step = (now - mark[0]) / (step - mark[1])
            left = budget_s - (now - t_start)
            max_steps = max(step + 1, min(cfg.max_steps, step + int(left / per_step)))
            sched = lr_scheduler(opt, cfg.warmup_steps, max_steps, cfg.min_lr_ratio, step)
            stop_at = max_steps if run_limit is None else min(max_steps, run_limit)
            mark = (now, step)
            bar.total = max_steps
        bar.update(1)
        if step % cfg.log_every == 0 or step == max_steps:
            flush()
            elapsed = time.perf_counter() - t_start
            bar.set_postfix(loss=f"{history[-1]:.3f}", tok_s=f"{tokens / elapsed:,.0f}")
        if step % cfg.save_every == 0 or step == stop_at:
            flush()
            torch.save({"model": drafter.state_dict(), "optimizer": opt.state_dict(),
                        "step": step, "max_steps": max_steps, "history": history}, state_file)
            save_drafter(drafter, out / f"checkpoint-{step}")
    flush()
    if step > first_step:
        last = {"loss": history[-1], "grad_norm": float(grad_norm),
                "acc_per_offset": (correct / total.clamp_min(1)).tolist()}
    bar.close()
    save_drafter(drafter, out)
    tail = history[-50:]
    summary = {
        "steps": step, "max_steps": max_steps, "sequences": len(ds),
        "final_loss": sum(tail) / max(1, len(tail)), "last_step": last,
        "seconds_this_run": time.perf_counter() - t_start,
        "tokens_per_second_this_run": tokens / max(1e-9, time.perf_counter() - t_start),
        "config": cfg.model_dump(), "drafter": dcfg.to_dict(), "loss_history": history,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
