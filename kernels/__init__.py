"""Triton kernels with a pure-torch reference for every op (see kernels/reference.py).

Installed under the import name `specdec_kernels` (the folder `kernels/` maps to it in
pyproject.toml): the name `kernels` belongs to Hugging Face's `kernels` package, which SGLang
requires and transformers probes, and installing over it would break both.
Modules (import them directly; this file imports nothing, so `import specdec_kernels` needs no
triton): `gate` (SpecFold residual gate, fold sources, compaction), `attention` (paged branch
attention), `merge` (exact merge of partial attention states), `tree_build` (a draft block's
token tree), `tree_accept` (its greedy walk after the verify), `tree_rejection` (its walk by
recursive rejection sampling at T > 0), `reference` (torch only), and the
torch compute layer every model shares: `qwen3` (the one Qwen3 decoder layer), `rope` (RoPE).
"""
