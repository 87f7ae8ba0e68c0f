"""What the two SpecFold benchmarks (`specfold_bench.py`, `specfold_fast_bench.py`) share: a
forced gate (`forced_gate`: folds a fixed share of draft rows, whatever their residuals) and a
random-weight block-diffusion model at the Qwen3-8B shape (`model_8b`: only the shape matters
for time).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen3Config


def forced_gate(ratios: tuple[float, float], dev):
    """A gate that folds a fixed share of draft rows: ratios[0] at the attention gate, [1] at the
    FFN gate (folded_layer calls the gate in that order)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    calls = [0]

    def gate_fn(h, parents, delta):
        r = ratios[calls[0] % 2]
        calls[0] += 1
        fold = torch.rand(h.shape[:2], generator=gen, device=dev) < r
        fold[0] = False
        return fold
    return gate_fn


def model_8b(layers: int, dev):
    cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                      tie_word_embeddings=False, eos_token_id=None, pad_token_id=None)
    cfg.dllm_block_size, cfg.mask_token_id = 16, 151669
    with torch.device(dev):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def tree_blocks(root, kept):
    """A binary-ish draft tree: each draft unmasks one more position of its parent."""
    parents = [-1] + [max(0, (i - 1) // 2) for i in range(1, kept + 1)]
    blocks = [root]
    for i, p in enumerate(parents[1:], 1):
        nxt = blocks[p].clone()
        nxt[6 + (i - 1) % 10] = 1000 + i
        blocks.append(nxt)
    return torch.stack(blocks), parents
