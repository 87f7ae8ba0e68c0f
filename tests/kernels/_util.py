"""Helpers for the kernel tests (see conftest.py for how they run on CPU)."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA else "cpu"
direct = pytest.mark.skipif(not (CUDA or INTERPRETED),
                            reason="runs in a TRITON_INTERPRET=1 subprocess (test_interpreter.py)")


def poison_empty(monkeypatch, module):
    """Make every torch.empty in `module` return poisoned memory (NaN, or -7 for integers)."""
    real = torch.empty

    def empty(*size, dtype=None, device=None, **kw):
        t = real(*size, dtype=dtype, device=device, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -7)
    monkeypatch.setattr(module.torch, "empty", empty)
