"""The training recipe: anchors, packed block mask, loss weights, a short run, exact resume."""

import json
import math

import pytest
import torch

from dflash_plugin.checkpoint import config_for_target, init_drafter, save_drafter
from dflash_plugin.errors import ConfigError, validated
from dflash_plugin.target import context_features
from dflash_plugin.training.anchors import (
    block_inputs,
    block_mask,
    loss_weights,
    sample_anchors,
)
from dflash_plugin.training.data import TokenDataset, load_prompts_jsonl, save_shard
from dflash_plugin.training.trainer import TrainConfig, block_loss, lr_scheduler, train
from tests.conftest import MASK_ID, greedy_reference, tiny_target


def naive_mask(anchors, block_size, ctx_len):
    a = len(anchors)
    m = torch.zeros(a * block_size, ctx_len + a * block_size, dtype=torch.bool)
    for q in range(a * block_size):
        j = q // block_size
        for c in range(ctx_len):
            m[q, c] = anchors[j] >= 0 and c < anchors[j]
        for k in range(a * block_size):
            m[q, ctx_len + k] = (k // block_size) == j
    return m


def test_anchor_sampler():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(10, 40, 8, gen)
    assert a.tolist() == sorted(set(a.tolist())) and len(a) == 8
    assert a.min() >= 10 and a.max() <= 38  # every anchor has at least one label
    few = sample_anchors(10, 14, 8, gen)  # only 10, 11, 12 qualify
    assert few.tolist() == [10, 11, 12, -1, -1, -1, -1, -1]
    assert (sample_anchors(10, 11, 4, gen) == -1).all()
    allpos = torch.cat([sample_anchors(5, 30, 6, gen) for _ in range(400)])
    counts = torch.bincount(allpos, minlength=29)[5:29].float()
    assert counts.min() > 0.6 * counts.mean()  # uniform over the response


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_block_mask_equals_naive(block_size):
    anchors = torch.tensor([[3, 7, 12, -1], [0, 5, 6, 9]])
    got = block_mask(anchors, block_size, 20)
    for row in range(2):
        assert torch.equal(got[row, 0], naive_mask(anchors[row].tolist(), block_size, 20))


def test_loss_weights_formula():
    w = loss_weights(16, 7.0)
    assert w[0] == 0
    for k in range(1, 16):
        assert math.isclose(w[k].item(), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)
    with pytest.raises(ConfigError, match="gamma"):
        loss_weights(16, 0.0)


def test_block_inputs_mask_padding_and_anchor():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 0, 0], [20, 21, 22, 23, 24, 25, 26, 27]])
    lengths = torch.tensor([6, 8])
    anchors = torch.tensor([[3, -1], [1, 5]])
    w = loss_weights(4, 2.0)
    ids, pos, labels, weights = block_inputs(tokens, lengths, anchors, 4, MASK_ID, w)
    assert ids[0, :4].tolist() == [13, MASK_ID, MASK_ID, MASK_ID]
    assert pos[1, 4:].tolist() == [5, 6, 7, 8]
    assert labels[0, :4].tolist()[:3] == [13, 14, 15]
    assert weights[0, 0] == 0  # the anchor itself
    assert weights[0, 3] == 0  # position 6 is padding
    assert (weights[0, 4:] == 0).all()  # inactive anchor
    assert weights[1, 7] == 0  # position 8 is past the end
    assert torch.allclose(weights[1, 1:4], w[1:4])


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    target = tiny_target("qwen3")
    prompts = [[5 + i, 17 + i, 29 + i, 41 + i] for i in range(8)]
    conts = greedy_reference(target, prompts, 48)
    folder = tmp_path_factory.mktemp("data")
    save_shard(folder / "shard-00000.pt", prompts[:4], conts[:4])
    save_shard(folder / "shard-00001.pt", prompts[4:], conts[4:])
    return target, folder


def _cfg(folder, out, **kw):
    base = dict(data=[str(folder)], out=str(out), num_layers=1, block_size=8, num_anchors=12,
                batch_size=4, max_steps=30, warmup_steps=3, lr=1e-2, save_every=15,
                mask_token_id=MASK_ID, log_every=5)
    return validated(TrainConfig, **{**base, **kw})


def _schedule(lr, warmup, max_steps, min_ratio, step):
    """The recipe's schedule in closed form: linear warm-up, then cosine to lr * min_ratio."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, max_steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@pytest.mark.parametrize("warmup,max_steps", [(50, 1000), (3, 30), (1, 10), (0, 12), (10, 8)])
def test_lr_scheduler_values(warmup, max_steps):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    sched = lr_scheduler(opt, warmup, max_steps, 0.1)
    got = []
    for _ in range(max_steps):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [_schedule(1e-2, warmup, max_steps, 0.1, s) for s in range(max_steps)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    if 1 < warmup < max_steps:  # hand-computed rows: ramp start, peak, cosine midpoint
        assert got[0] == pytest.approx(1e-2 / warmup) and got[warmup] == pytest.approx(1e-2)
    if (max_steps - warmup) % 2 == 0 and warmup < max_steps:  # half-way: lr * (1 + 0.1) / 2
        assert got[warmup + (max_steps - warmup) // 2] == pytest.approx(1e-2 * 0.55)


def test_lr_scheduler_resumes_at_a_step():
    """A resumed run (or a re-planned horizon) rebuilds the schedule at its step."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    lr_scheduler(opt, 5, 100, 0.1)
    for step in (0, 4, 5, 37, 99):
        sched = lr_scheduler(opt, 5, 100, 0.1, step)
        assert opt.param_groups[0]["lr"] == pytest.approx(_schedule(1e-2, 5, 100, 0.1, step))
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(_schedule(1e-2, 5, 100, 0.1, step + 1))


def test_dataset_reads_shards(tiny_data):
    _, folder = tiny_data
    ds = TokenDataset([folder], min_response=8)
    assert len(ds) == 8
    ids, lengths, plens = ds.batch([0, 5], max_len=30)
    assert ids.shape == (2, 30) and plens.tolist() == [0, 0]  # cut from the left
    ids, lengths, plens = ds.batch([0, 5], max_len=100)
    assert lengths.tolist() == [52, 52] and plens.tolist() == [4, 4]


def test_short_run_lowers_loss_and_writes_zlab(tiny_data, tmp_path):
    target, folder = tiny_data
    summary = train(_cfg(folder, tmp_path / "run"), target)
    hist = summary["loss_history"]
    assert sum(hist[-5:]) / 5 < 0.95 * sum(hist[:5]) / 5
    raw = json.loads((tmp_path / "run" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 8
    assert (tmp_path / "run" / "checkpoint-15" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 30


def test_resume_is_exact(tiny_data, tmp_path):
    target, folder = tiny_data
    train(_cfg(folder, tmp_path / "full"), target)
    train(_cfg(folder, tmp_path / "half", steps_this_run=15), target)  # interrupted at 15
    state_file = tmp_path / "half" / "trainer_state.pt"
    assert torch.load(state_file)["step"] == 15
    train(_cfg(folder, tmp_path / "half"), target)  # picks up from the saved state
    full = torch.load(tmp_path / "full" / "trainer_state.pt")["model"]
    resumed = torch.load(state_file)["model"]
    for name in full:
        assert torch.equal(full[name], resumed[name]), name


def test_bad_training_input(tiny_data, tmp_path):
    target, folder = tiny_data
    with pytest.raises(ConfigError, match="gamma"):
        _cfg(folder, tmp_path, gamma=0)
    with pytest.raises(ConfigError, match="block_size"):
        train(_cfg(folder, tmp_path / "b", block_size=64), target)  # responses are 48 tokens
    with pytest.raises(ConfigError, match="data"):
        train(_cfg(tmp_path / "empty", tmp_path / "c"), target)
    wide = tiny_target("qwen3")
    cfg = config_for_target(wide.config, num_layers=1, block_size=8, mask_token_id=MASK_ID)
    save_drafter(init_drafter(cfg.replace(hidden_size=32, head_dim=8)), tmp_path / "d")
    with pytest.raises(ConfigError, match="hidden_size"):
        train(_cfg(folder, tmp_path / "e", init_from=str(tmp_path / "d")), target)


def test_prompts_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_prompts_jsonl(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        load_prompts_jsonl(bad)
    bad.write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match="'prompt'"):
        load_prompts_jsonl(bad)


def test_packed_forward_equals_dense_block_mask(qwen3_target):
    cfg = config_for_target(qwen3_target.config, num_layers=2, block_size=4, mask_token_id=MASK_ID)
    drafter = init_drafter(cfg, seed=2, std=0.1)
    gen = torch.Generator().manual_seed(0)
    L, bs = 20, 4
    anchors = torch.tensor([[3, 7, 12, -1], [0, 5, 6, 15]])
    ctx = torch.randn(2, L, cfg.num_context_features, generator=gen)
    emb = torch.randn(2, 4 * bs, 64, generator=gen)
    pos = (anchors.clamp_min(0)[:, :, None] + torch.arange(bs)).reshape(2, -1)
    ctx_pos = torch.arange(L)[None].expand(2, -1)
    with torch.no_grad():
        dense = drafter(emb, pos, ctx, ctx_pos, None, None,
                        attn_mask=block_mask(anchors, bs, L))
        packed = drafter.forward_packed(emb, pos, ctx, anchors)
    torch.testing.assert_close(packed, dense, rtol=1e-5, atol=1e-5)


def test_block_loss_equals_naive_per_block_loss(qwen3_target):
    """The static-shape loss (all rows, zero weights) equals a per-block loop that runs each block
    alone over the context before its anchor and sums only labelled offsets; counts likewise."""
    bs = 4
    cfg = config_for_target(qwen3_target.config, num_layers=2, block_size=bs,
                            mask_token_id=MASK_ID)
    drafter = init_drafter(cfg, seed=3, std=0.1)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (2, 14), generator=gen)
    lengths = torch.tensor([14, 9])
    anchors = torch.tensor([[4, 11, 12], [2, 6, -1]])  # 11, 12 run past the end; -1 inactive
    w_k = loss_weights(bs, 2.0)
    tc = TrainConfig(data=["x"], out="x", block_size=bs, num_anchors=3, packed_attention="dense")
    with torch.no_grad():
        loss, correct, total = block_loss(drafter, qwen3_target, ids, lengths, anchors, tc,
                                          MASK_ID, w_k)
        feats = context_features(qwen3_target(input_ids=ids, output_hidden_states=True)
                                 .hidden_states, cfg.target_layer_ids)
        emb = qwen3_target.get_input_embeddings()
        head = qwen3_target.get_output_embeddings()
        num = den = 0.0
        ref_correct, ref_total = torch.zeros(bs), torch.zeros(bs)
        for r in range(2):
            for anchor in anchors[r].tolist():
                if anchor < 0:
                    continue
                blk = torch.tensor([ids[r, anchor].item()] + [MASK_ID] * (bs - 1))
                pos = torch.arange(anchor, anchor + bs)[None]
                h = drafter(emb(blk)[None], pos, feats[r:r + 1, :anchor],
                            torch.arange(anchor)[None], None)
                logits = head(h)[0]
                for k in range(1, bs):
                    if anchor + k >= lengths[r]:
                        continue
                    label = ids[r, anchor + k]
                    ce = torch.nn.functional.cross_entropy(logits[k], label)
                    num, den = num + w_k[k] * ce, den + w_k[k]
                    ref_total[k] += 1
                    ref_correct[k] += float(logits[k].argmax() == label)
    torch.testing.assert_close(loss, num / den, rtol=1e-4, atol=1e-5)
    assert torch.equal(total, ref_total) and torch.equal(correct, ref_correct)


def test_compiled_pointwise_trains_like_eager(tiny_data, tmp_path):
    """`compile=True` swaps in torch.compile'd RMSNorm / RoPE / SiLU-mul for the run (forward and
    backward): same losses step by step, and eager ops are back afterwards."""
    from specdec_kernels.qwen3 import EAGER, default_ops
    from torch._dynamo.utils import counters

    target, folder = tiny_data
    counters.clear()
    runs = [train(_cfg(folder, tmp_path / str(c), max_steps=4, compile=c), target)
            for c in (False, True)]
    assert counters["stats"]["unique_graphs"] >= 3  # the three pieces really were compiled
    torch.testing.assert_close(torch.tensor(runs[0]["loss_history"]),
                               torch.tensor(runs[1]["loss_history"]), rtol=1e-4, atol=1e-5)
    assert default_ops() is EAGER  # eager ops are back


def test_packed_attention_modes_train_identically(tiny_data, tmp_path):
    """'dense' (one score matrix per row under the block mask) and 'expand' (per-block context
    copies) are the same computation: same losses step by step."""
    target, folder = tiny_data
    runs = [train(_cfg(folder, tmp_path / mode, max_steps=6, packed_attention=mode), target)
            for mode in ("expand", "dense")]
    torch.testing.assert_close(torch.tensor(runs[0]["loss_history"]),
                               torch.tensor(runs[1]["loss_history"]), rtol=1e-4, atol=1e-5)


def test_make_data_fast_runtime_equals_hf_generate(tmp_path):
    """`make-data --fast` (static-cache runtime) writes exactly the shards HF `generate` writes:
    ragged prompts, several batches, a last batch smaller than the decoder's batch."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_plugin.training.data import make_data

    fix = Path(__file__).resolve().parents[2] / "examples/fixtures/code-target"
    tok = AutoTokenizer.from_pretrained(fix)
    model = AutoModelForCausalLM.from_pretrained(fix, dtype=torch.float32).eval()
    prompts = ["import os\n", "def add(a, b):\n    return", "class Stack:\n    def __init__(self",
               "for i in range(10):\n", "x = [1, 2"]
    out = {}
    for fast in (False, True):
        folder = make_data(model, tok, prompts, tmp_path / str(fast), max_new_tokens=20,
                           shard_size=4, batch_size=3, fast=fast)
        out[fast] = [torch.load(f) for f in sorted(folder.glob("shard-*.pt"))]
    assert len(out[True]) == len(out[False]) == 2
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["offsets"], b["offsets"])
    with pytest.raises(ConfigError, match="fast"):
        make_data(model, tok, prompts, tmp_path / "t1", temperature=1.0, fast=True)
