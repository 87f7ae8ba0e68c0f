"""Triton kernels with a pure-torch reference for every op (see kernels/reference.py).

Note: the import name `kernels` is shared with Hugging Face's `kernels` package. This package
never defines `get_kernel`, so transformers' `is_kernels_available()` stays False with it installed.
"""
