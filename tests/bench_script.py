"""`benchmarks/NAME.py` loaded as a module the way `python benchmarks/NAME.py` imports: the
benchmarks folder first on `sys.path` (the scripts import `bench`) while the context is open,
`sys.path` restored after (a script's `checkout_first` reorders it)."""

import contextlib
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def bench_script(name: str):
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path[:] = saved
