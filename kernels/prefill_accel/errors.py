"""Errors of the command line tools: each one message for the user and the exit code the CLI returns.

The tooling (prefill_accel.tooling.errors) and the serving tools (prefill_accel.serving.errors) add
their own; docs/tooling.md lists every code.
"""

from __future__ import annotations


class CommandError(Exception):
    """A failure the CLI reports as one message and an exit code (1: the operation failed)."""

    exit_code = 1


class UsageError(CommandError):
    """Bad arguments, unknown names, missing files: nothing was tried."""

    exit_code = 2
