"""Fixtures of the SGLang checks, loaded as a pytest plugin (`-p`) by `test_sglang.py`'s
subprocess only: the shim and SGLang's own plugin loading (as its launcher does) before
collection, the converted SDAR checkpoint, a small draft graph, server args from argv."""

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FIX = ROOT / "examples" / "fixtures"
DLLM = FIX / "code-dllm"
# This distribution's `sglang.srt.plugins` entry points, one per package.
ENTRY_POINTS = {"dflash_plugin": "dflash_plugin.engines.sglang:register",
                "spiffy_plugin": "spiffy_plugin.engines.sglang:register",
                "specfold_plugin": "specfold_plugin.engines.sglang:register"}


def pytest_configure(config):
    from tests.engines.sglang_env import shims

    shims.install()
    from sglang.srt.plugins import load_plugins

    os.environ.setdefault("SGLANG_PLUGINS", ",".join(ENTRY_POINTS))
    load_plugins()


@pytest.fixture(scope="session")
def sdar_dir(tmp_path_factory):
    from spiffy_plugin.engines.sdar import convert_to_sdar

    assert (DLLM / "config.json").is_file(), f"bundled fixture missing: {DLLM}"
    return convert_to_sdar(DLLM, tmp_path_factory.mktemp("sdar") / "code-dllm-sdar")


@pytest.fixture(scope="session")
def graph_path(tmp_path_factory):
    from spiffy_plugin.graph import DraftGraph, Node

    nodes = (Node.of([(0, 0)], 1), Node.of([(0, 1)], 1), Node.of([(0, 0), (1, 0)], 2))
    path = tmp_path_factory.mktemp("graph") / "graph.json"
    DraftGraph(nodes, (5, 2, 3), 16, 16384, "vanilla-1").save(path)
    return str(path)


def server_args(model, algorithm, config: dict | None, tmp_path):
    """SGLang's ServerArgs from the same strings as `sglang.launch_server`'s command line."""
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", str(model), "--device", "cpu", "--dllm-algorithm", algorithm]
    if config is not None:
        path = tmp_path / f"{algorithm}.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        argv += ["--dllm-algorithm-config", str(path)]
    return prepare_server_args(argv)
