"""Errors raised on bad user input: `ConfigError`, `require` and the pydantic converters
`config_error` / `validated`, all defined once in `specdec_kernels.errors`."""

from __future__ import annotations

from specdec_kernels.errors import ConfigError, config_error, require, validated

__all__ = ["ConfigError", "config_error", "require", "validated"]
