"""The one error type for bad user input, shared by every package of this distribution.

A `ConfigError` names the offending field, the value it got and the allowed range, and is raised
before any work starts (`dflash_plugin.errors` and `spiffy_plugin.errors` re-export it).
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
