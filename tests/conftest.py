"""Shared test fixtures: tiny random targets (Qwen3, Llama) and drafters fitted to them.

`fit_drafter` is a few hundred Adam steps of block prediction on the target's own greedy
continuation, only so that tests see partial acceptance (tau strictly between 1 and B); it is not
the training recipe.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from dflash_plugin.checkpoint import config_for_target, init_drafter
from dflash_plugin.target import context_features

VOCAB = 97
MASK_ID = 3


def tiny_target(arch: str = "qwen3", vocab: int = VOCAB, seed: int = 0, layers: int = 4,
                std: float = 0.02):
    common = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=vocab,
                  max_position_embeddings=256, pad_token_id=1, eos_token_id=None,
                  bos_token_id=None, initializer_range=std)
    cfg = Qwen3Config(head_dim=16, **common) if arch == "qwen3" else LlamaConfig(**common)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def greedy_reference(target, prompts, max_new_tokens, eos_token_id=None):
    """Plain decoding, one prompt at a time: the ground truth for token identity."""
    out = []
    for p in prompts:
        kw = {"eos_token_id": eos_token_id} if eos_token_id is not None else {
            "min_new_tokens": max_new_tokens}
        ids = target.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=1, **kw)
        out.append(ids[0, len(p):].tolist())
    return out


def fit_drafter(target, drafter, sequences, block_size, steps=150, lr=3e-3, seed=0):
    """Fit `drafter` to predict blocks of `sequences` (lists of ids) from the target's features."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(sequences)  # [n, L], equal lengths
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        feats = context_features(out.hidden_states, drafter.config.target_layer_ids)
        embeds = target.get_input_embeddings()(ids)
        mask_embed = target.get_input_embeddings()(torch.tensor([MASK_ID]))
    head = target.get_output_embeddings()
    n, length = ids.shape
    opt = torch.optim.Adam(drafter.parameters(), lr=lr)
    drafter.train()
    for _ in range(steps):
        rows = torch.randint(0, n, (32,), generator=gen)
        anchors = torch.randint(1, length - block_size, (32,), generator=gen)
        offs = torch.arange(block_size)
        pos = anchors[:, None] + offs  # [32, B]
        block = mask_embed.expand(32, block_size, -1).clone()
        block[:, 0] = embeds[rows, anchors]
        ctx_pos = torch.arange(length)[None].expand(32, -1)
        valid = ctx_pos < anchors[:, None]
        hidden = drafter(block, pos, feats[rows], ctx_pos, valid, None)
        logits = head(hidden[:, 1:])
        labels = ids[rows[:, None], pos[:, 1:]]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="session")
def qwen3_target():
    return tiny_target("qwen3")


@pytest.fixture(scope="session")
def llama_target():
    return tiny_target("llama", seed=1)


def fitted_drafter(target, num_layers=2, block_size=8, seed=0):
    """A drafter fitted to the target's greedy continuations of a few fixed prompts."""
    prompts = [[5 + i, 17 + i, 29 + i, 41 + i] for i in range(6)]
    conts = greedy_reference(target, prompts, 60)
    cfg = config_for_target(target.config, num_layers=num_layers, block_size=block_size,
                            mask_token_id=MASK_ID)
    drafter = init_drafter(cfg, seed=seed)
    return fit_drafter(target, drafter, [p + c for p, c in zip(prompts, conts)], block_size)
