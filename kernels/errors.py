"""The one error type for bad user input, shared by every package of this distribution.

A `ConfigError` names the offending field, the value it got and the allowed range, and is raised
before any work starts (`dflash_plugin.errors` and `spiffy_plugin.errors` re-export it). The
pydantic side of the same contract: `config_error` turns a `ValidationError` of a config model
into a `ConfigError` naming the field, the value and the allowed range (read from the field's
`Field(ge=, gt=, le=, lt=)` bounds); `validated` builds a model that way (pydantic is imported
only there). `env_flag` reads a 0/1 environment switch the same way, `env_choice` one of
several values.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration, checkpoint or request field is missing, out of range or contradictory."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def require(condition: bool, field: str, message: str) -> None:
    """Raise `ConfigError(field, message)` unless `condition` holds."""
    if not condition:
        raise ConfigError(field, message)


def env_flag(environ, name: str, default: str, meaning: str) -> bool:
    """An environment switch `name` of 0 or 1 (`default` when unset or blank); any other value
    raises `ConfigError` with `meaning` (what 1 turns on)."""
    raw = environ.get(name, default).strip() or default
    if raw not in ("0", "1"):
        raise ConfigError(name, f"must be 0 or 1 ({meaning}), got {raw!r}")
    return raw == "1"


def env_choice(environ, name: str, default: str, allowed: tuple[str, ...], meaning: str) -> str:
    """An environment switch `name` of one of `allowed` (lower-cased; `default` when unset or
    blank); any other value raises `ConfigError` listing them, with `meaning` (what it sets)."""
    raw = environ.get(name, default).strip().lower() or default
    if raw not in allowed:
        listed = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
        raise ConfigError(name, f"must be {listed} ({meaning}), got {raw!r}")
    return raw


_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string"}


def allowed_range(model_cls: Any, name: str) -> str | None:
    """The range a field's bounds allow, as messages write it: "in (0, 1]", ">= 1", or None."""
    info = getattr(model_cls, "model_fields", {}).get(name)
    lo = hi = None
    for m in getattr(info, "metadata", ()):
        if getattr(m, "ge", None) is not None:
            lo = ("[", ">=", m.ge)
        elif getattr(m, "gt", None) is not None:
            lo = ("(", ">", m.gt)
        elif getattr(m, "le", None) is not None:
            hi = ("]", "<=", m.le)
        elif getattr(m, "lt", None) is not None:
            hi = (")", "<", m.lt)
    if lo and hi:
        return f"in {lo[0]}{lo[2]}, {hi[2]}{hi[0]}"
    if lo or hi:
        b = lo or hi
        return f"{b[1]} {b[2]}"
    return None


def config_error(model_cls: Any, err: Any, prefix: str = "") -> ConfigError:
    """A pydantic `ValidationError` of `model_cls` as a `ConfigError`: the field (`prefix` +
    its name), the value it got and the allowed range or type; a `ConfigError` raised inside a
    validator passes through; unknown fields (`extra="forbid"`) are listed with the allowed
    ones."""
    errors = err.errors()
    inner = (errors[0].get("ctx") or {}).get("error")
    if isinstance(inner, ConfigError):
        return inner
    extra = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        allowed = sorted(getattr(model_cls, "model_fields", {}))
        return ConfigError(prefix.rstrip(": .") or model_cls.__name__,
                           f"unknown keys {sorted(extra)}; allowed: {allowed}")
    first = errors[0]
    loc = first["loc"]
    field = prefix + (".".join(str(p) for p in loc) or model_cls.__name__)
    value = first.get("input")
    if first["type"] == "missing":
        return ConfigError(field, "required")
    rng = allowed_range(model_cls, loc[0]) if len(loc) == 1 else None
    kind = next((k for t, k in _KINDS.items() if first["type"].startswith(t)), None)
    if rng is not None or kind is not None:
        what = " ".join(w for w in (kind, rng) if w)
        return ConfigError(field, f"must be {what}, got {value!r}")
    return ConfigError(field, f"{first['msg']} (got {value!r})")


def validated(model_cls: Any, prefix: str = "", **fields: Any) -> Any:
    """Construct a pydantic model; its errors become a `ConfigError` naming the field."""
    from pydantic import ValidationError

    try:
        return model_cls(**fields)
    except ValidationError as err:
        raise config_error(model_cls, err, prefix) from None
