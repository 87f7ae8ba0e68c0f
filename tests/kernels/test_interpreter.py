"""Runs the kernel tests of this folder (and the fast tree loop's Triton-backend tests) in
subprocesses with TRITON_INTERPRET=1 (CPU machines): two shards at once, one core each (the
parent waits meanwhile), each about 6 minutes on a 2-core CI machine (12 minutes in one)."""

import os
import re
import sys

import pytest

from tests.kernels._util import CUDA, INTERPRETED
from tests.subprocs import run_at_once

HERE = "tests/kernels"
SLOW = f"{HERE}/test_invariant_attention.py"  # the invariant decoders: half of the time
SHARDS = (
    [SLOW],
    [HERE, f"--ignore={SLOW}", f"--ignore={HERE}/test_interpreter.py",
     f"--ignore={HERE}/test_compile.py",
     f"--ignore={HERE}/test_matmul_compile.py",  # compile-only files skip under it
     "tests/dflash/test_fast_tree.py::test_plan_block_mask_triton_equals_sdpa",
     "tests/dflash/test_fast_tree.py::test_tree_loop_triton_backend"],  # the tree's mask
)


@pytest.mark.skipif(CUDA or INTERPRETED, reason="kernel tests already run in this process")
def test_kernels_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    runs = run_at_once([base + shard for shard in SHARDS], env)
    for (rc, out, err), shard in zip(runs, SHARDS):
        assert rc == 0, f"{shard[0]}: " + out[-8000:] + err[-2000:]
        last = out.strip().splitlines()[-1]
        assert re.match(r"\d+ passed in ", last), out[-2000:]  # and nothing skipped
