"""Test-only: installs the torchvision shim (`../shims.py`) in every process of an SGLang server
started by `tests/engines/test_sglang_serve.py` (launcher, scheduler, detokenizer), which is the
only place that puts this folder on PYTHONPATH."""

from tests.engines.sglang_env import shims

shims.install()
