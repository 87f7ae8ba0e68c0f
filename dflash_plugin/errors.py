"""Errors raised on bad user input: `ConfigError`, `require`, `env_flag`, `env_choice` and the
pydantic converters `config_error` / `validated`, all defined once in `specdec_kernels.errors`."""

from __future__ import annotations

from specdec_kernels.errors import (
    ConfigError,
    config_error,
    env_choice,
    env_flag,
    require,
    validated,
)

__all__ = ["ConfigError", "config_error", "env_choice", "env_flag", "require", "validated"]
