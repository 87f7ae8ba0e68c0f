"""One `ConfigError` for the whole distribution: every package's name for it is the same class,
so a caller catches bad input from any package with one `except`."""

import specdec_kernels.errors as base

import dflash_plugin.errors as dflash_errors
import spiffy_plugin.errors as spiffy_errors
from specfold_plugin import specfold
from specfold_plugin.engines import sglang as specfold_sglang


def test_one_config_error_class():
    assert dflash_errors.ConfigError is base.ConfigError
    assert spiffy_errors.ConfigError is base.ConfigError
    assert dflash_errors.require is spiffy_errors.require is base.require


def test_require_names_the_field():
    try:
        base.require(False, "block_size", "must be >= 2, got 1")
    except dflash_errors.ConfigError as err:  # caught under another package's name
        assert err.field == "block_size"
        assert str(err) == "block_size: must be >= 2, got 1"
    else:
        raise AssertionError("require(False, ...) did not raise")
    base.require(True, "block_size", "unused")


def test_one_default_delta():
    assert specfold_sglang.DEFAULT_DELTA is specfold.DEFAULT_DELTA
