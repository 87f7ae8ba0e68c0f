"""Benchmark scripts (`benchmarks/NAME.py`) loaded as modules the way `python benchmarks/NAME.py`
imports: `on_bench_path()` puts the benchmarks folder first on `sys.path` (the scripts import
`bench`) and restores `sys.path` after (a script's `checkout_first` reorders it); `load(NAME)`
executes one script inside it."""

import contextlib
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def on_bench_path():
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path[:] = saved


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
