"""Errors raised on bad user input: a `ConfigError` names the field, the value and the allowed
range, and is raised before any model work starts."""

from __future__ import annotations

import sys


class ConfigError(ValueError):
    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ConfigError(field, message)


def run_command(args) -> int:
    """Run a parsed CLI subcommand (`args.func`); a ConfigError becomes a one-line message on
    stderr and exit status 2."""
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
