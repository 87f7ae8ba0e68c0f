"""Triton kernels with a pure-torch reference for every op (see kernels/reference.py).

Modules (import them directly; this file imports nothing, so `import kernels` needs no triton):
`gate` (SpecFold residual gate, fold sources, compaction), `attention` (paged branch attention),
`merge` (exact merge of partial attention states), `reference` (torch only).

Note: the import name `kernels` is shared with Hugging Face's `kernels` package. This package
never defines `get_kernel`, so transformers' `is_kernels_available()` stays False with it installed.
"""
