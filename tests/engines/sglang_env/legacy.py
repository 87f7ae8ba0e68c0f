"""Pytest plugin (`-p`) of the checks against the oldest supported SGLang (0.5.16, with the
transformers 5.12.1 it pins), run by `tests/engines/test_versions.py` in a subprocess whose path
holds `.venv/sglang-0.5.16` (installed by `make setup`). Test-only; never imported by the packages.

Before collection: the torchvision shim (`shims.py`) plus what SGLang 0.5.16 on transformers 5.12.1
also needs (`install`), then SGLang's own plugin loading as its launcher does it, with every log
record of it kept in `RECORDS`. The fixtures are those of `fixtures.py`.
"""

import logging
import os
import sys

from tests.engines.sglang_env.fixtures import (  # noqa: F401 (fixtures)
    ENTRY_POINTS,
    graph_path,
    sdar_dir,
)

RECORDS: list[logging.LogRecord] = []


class _Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        RECORDS.append(record)


def install() -> None:
    """`shims.install()`, and: SGLang 0.5.16 imports `torchvision.io` too; transformers 5.12.1
    exports `AutoImageProcessor` as a placeholder that raises when torchvision is missing (SGLang's
    config package registers image processors at import), so the real class is exported."""
    from tests.engines.sglang_env import shims

    shims.install()
    if "torchvision.io" not in sys.modules:
        sys.modules["torchvision"].io = shims._stub("torchvision.io", package=False)
    import transformers.processing_utils  # noqa: F401 (settles transformers' lazy module first)
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    sys.modules["transformers"].AutoImageProcessor = AutoImageProcessor


def pytest_configure(config):
    install()
    from sglang.srt.plugins import load_plugins

    root = logging.getLogger()
    root.addHandler(_Keep(logging.INFO))
    root.setLevel(min(root.level, logging.INFO))
    os.environ.setdefault("SGLANG_PLUGINS", ",".join(ENTRY_POINTS))
    load_plugins()
