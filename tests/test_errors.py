"""One `ConfigError` for the whole distribution: every package's name for it is the same class,
so a caller catches bad input from any package with one `except`."""

import pytest
import specdec_kernels.errors as base

import dflash_plugin.errors as dflash_errors
import spiffy_plugin.errors as spiffy_errors
from specfold_plugin import specfold
from specfold_plugin.engines import sglang as specfold_sglang


def test_one_config_error_class():
    assert dflash_errors.ConfigError is base.ConfigError
    assert spiffy_errors.ConfigError is base.ConfigError
    assert dflash_errors.require is spiffy_errors.require is base.require
    assert dflash_errors.config_error is spiffy_errors.config_error is base.config_error
    assert dflash_errors.validated is spiffy_errors.validated is base.validated


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


def _bad(model, **fields) -> str:
    try:
        dflash_errors.validated(model, **fields)
    except base.ConfigError as err:
        return str(err)
    raise AssertionError(f"{model.__name__}({fields}) was accepted")


def test_pydantic_errors_name_field_value_and_range():
    from pydantic import BaseModel, ConfigDict, Field

    from dflash_plugin.sampling import SamplingParams
    from dflash_plugin.training.trainer import TrainConfig

    class M(BaseModel):
        model_config = ConfigDict(extra="forbid")
        n: int = Field(1, ge=1)
        p: float = Field(1.0, gt=0, le=1)
        t: float = Field(0.0, ge=0)
        k: int = Field(5, lt=10)

    cases = [  # (fields, message): one row per kind of error
        ({"n": 0}, "n: must be >= 1, got 0"),
        ({"p": 0}, "p: must be in (0, 1], got 0"),
        ({"p": 1.5}, "p: must be in (0, 1], got 1.5"),
        ({"t": -0.5}, "t: must be >= 0, got -0.5"),
        ({"k": 10}, "k: must be < 10, got 10"),
        ({"n": "two"}, "n: must be an integer >= 1, got 'two'"),
        ({"p": "x"}, "p: must be a number in (0, 1], got 'x'"),
        ({"nn": 1, "a": 2}, "M: unknown keys ['a', 'nn']; allowed: ['k', 'n', 'p', 't']"),
    ]
    for fields, message in cases:
        assert _bad(M, **fields) == message
    assert _bad(TrainConfig, data=["d"], out="o", warmup_steps=-1) == (
        "warmup_steps: must be >= 0, got -1")
    assert "unknown keys ['lr_max']" in _bad(TrainConfig, data=["d"], out="o", lr_max=1.0)
    try:  # SamplingParams validates on construction, without `validated`
        SamplingParams(0.7, 1.5)
    except base.ConfigError as err:
        assert (err.field, str(err)) == ("top_p", "top_p: must be in (0, 1], got 1.5")
    else:
        raise AssertionError("SamplingParams(top_p=1.5) was accepted")


def test_env_choice_reads_one_of_several_values():
    """Unset or blank: the default; any case; anything else a ConfigError naming the variable,
    every allowed value, what it sets and the value got."""
    allowed = ("auto", "0", "1")
    assert base.env_choice({}, "X_MODE", "auto", allowed, "m") == "auto"
    assert base.env_choice({"X_MODE": " "}, "X_MODE", "1", allowed, "m") == "1"
    assert base.env_choice({"X_MODE": "AUTO"}, "X_MODE", "0", allowed, "m") == "auto"
    with pytest.raises(base.ConfigError, match=r"X_MODE: must be auto, 0 or 1 \(m\), got '2'"):
        base.env_choice({"X_MODE": "2"}, "X_MODE", "auto", allowed, "m")
    assert dflash_errors.env_choice is base.env_choice
