"""Errors raised on bad user input: `ConfigError`, `require`, `config_error`, `validated`,
`env_flag` (defined once, in `specdec_kernels.errors`), and `run_command`, which turns one into
a CLI message."""

from __future__ import annotations

import sys

from specdec_kernels.errors import ConfigError, config_error, env_flag, require, validated

__all__ = ["ConfigError", "config_error", "env_flag", "require", "run_command", "validated"]


def run_command(args) -> int:
    """Run a parsed CLI subcommand (`args.func`); a ConfigError becomes a one-line message on
    stderr and exit status 2."""
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
