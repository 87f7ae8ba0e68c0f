"""Runs the kernel tests of this folder (and the fast tree loop's Triton-backend tests) in a
subprocess with TRITON_INTERPRET=1 (CPU machines)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels._util import CUDA, INTERPRETED

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(CUDA or INTERPRETED, reason="kernel tests already run in this process")
def test_kernels_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    here = "tests/kernels"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", here,
           f"--ignore={here}/test_interpreter.py", f"--ignore={here}/test_compile.py",
           f"--ignore={here}/test_matmul_compile.py",  # compile-only files skip under it
           "tests/dflash/test_fast_tree.py::test_plan_block_mask_triton_equals_sdpa",
           "tests/dflash/test_fast_tree.py::test_tree_loop_triton_backend"]  # the tree's mask
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert re.match(r"\d+ passed in ", last), r.stdout[-2000:]  # and nothing skipped
