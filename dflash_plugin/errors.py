"""Errors raised on bad user input.

A `ConfigError` always names the offending field, the value it got and the allowed range, and
is raised before any model work starts.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration, checkpoint or request field is missing, out of range or contradictory."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def require(condition: bool, field: str, message: str) -> None:
    """Raise `ConfigError(field, message)` unless `condition` holds."""
    if not condition:
        raise ConfigError(field, message)


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
