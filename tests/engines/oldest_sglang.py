"""Runs a checks file of `sglang_env/` against the oldest supported SGLang (0.5.16 with the
transformers it pins, `.venv/sglang-0.5.16`, installed by `make setup`) in one subprocess with
the legacy plugin (`sglang_env/legacy.py`), and reads each check's outcome from its JUnit XML."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocs import junit_results

ROOT = Path(__file__).resolve().parents[2]
LEGACY_ENV = ROOT / ".venv" / "sglang-0.5.16"


def check_names(path: Path) -> list[str]:
    """The test functions a checks file defines (one parametrised test of ours per check)."""
    return [n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def run_checks(path: Path | list[Path], tmp: Path, timeout: int = 1800,
               **env: str) -> dict[str, tuple[str, str]]:
    """{check id: ("passed" | "failed" | "skipped", message)} of one checks file or several
    (one subprocess); skips without the env."""
    paths = [path] if isinstance(path, Path) else list(path)
    if not (LEGACY_ENV / "sglang").is_dir():
        pytest.skip(f"oldest-SGLang env missing ({LEGACY_ENV}): `make setup` installs it")
    full = dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), str(LEGACY_ENV)]), **env)
    junit = tmp / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", *map(str, paths), "-q", "-p",
                           "no:cacheprovider", "-p", "tests.engines.sglang_env.legacy",
                           f"--junitxml={junit}"], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)
    if not junit.is_file():
        names = ", ".join(p.name for p in paths)
        pytest.fail(f"{names} did not run in the oldest SGLang:\n{proc.stdout[-4000:]}"
                    f"{proc.stderr[-4000:]}")
    return junit_results(junit)
