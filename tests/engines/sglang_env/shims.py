"""Test-only shim for the SGLang test environment (never imported by the packages).

`torchvision` is left out of that environment: its PyPI build needs a CUDA torch and breaks the
CPU torch on import. SGLang's config package imports it at module level for two vision models
(`multimodal/internvl_utils.py`, `configs/deepseek_ocr.py`), so `install()` registers a stub
whose every attribute raises when *used*. transformers' torchvision probe is cached as False first,
so transformers does not take the stub for a real torchvision.
"""

from __future__ import annotations

import sys
import types


class _Missing:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is shimmed in the SGLang test env")

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")


def _stub(name: str, package: bool) -> types.ModuleType:
    mod = types.ModuleType(name, "test shim: torchvision is not installed")

    def missing(attr: str, _name=name):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return _Missing(f"{_name}.{attr}")

    mod.__getattr__ = missing
    if package:
        mod.__path__ = []
    sys.modules[name] = mod
    return mod


def install() -> None:
    import transformers.utils.import_utils as hf_imports

    if "torchvision" in sys.modules:
        return
    assert not hf_imports.is_torchvision_available(), "a real torchvision is installed"
    hf_imports.is_torchvision_v2_available()  # cached as False before the stub exists
    tv = _stub("torchvision", package=True)
    tv.transforms = _stub("torchvision.transforms", package=True)
    tv.transforms.functional = _stub("torchvision.transforms.functional", package=False)
