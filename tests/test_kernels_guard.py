"""Our Triton kernels install as `specdec_kernels`, never as `kernels` (Hugging Face's name):
transformers must not take this project for HF `kernels`. `tests/test_install.py` checks the
same with the built wheel next to the real HF package in a clean venv."""

import importlib.metadata

import specdec_kernels


def test_transformers_does_not_see_hf_kernels():
    from transformers.utils import import_utils

    assert not hasattr(specdec_kernels, "get_kernel")
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:  # HF kernels not installed in this venv
        assert import_utils.is_kernels_available() is False


def test_import_name_maps_to_the_kernels_folder():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert Path(specdec_kernels.__file__).resolve() == root / "kernels" / "__init__.py"
