"""Errors raised on bad user input: `ConfigError` and `require` (defined once, in
`specdec_kernels.errors`) and `validated`, which turns a pydantic error into a `ConfigError`
naming the field."""

from __future__ import annotations

from specdec_kernels.errors import ConfigError, require

__all__ = ["ConfigError", "require", "validated"]


def validated(model_cls, **fields):
    """Construct a pydantic model, turning its errors into a `ConfigError` naming the field."""
    from pydantic import ValidationError

    try:
        return model_cls(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        inner = (first.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):
            raise inner from None
        field = ".".join(str(p) for p in first["loc"]) or model_cls.__name__
        raise ConfigError(field, f"{first['msg']} (got {first.get('input')!r})") from None
