"""Our top-level `kernels` package must not be mistaken for Hugging Face's `kernels`."""

import kernels


def test_transformers_does_not_see_hf_kernels():
    from transformers.utils import import_utils

    assert not hasattr(kernels, "get_kernel")
    assert import_utils.is_kernels_available() is False
