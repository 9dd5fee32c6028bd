"""Errors of the serving tools, each a CommandError so the CLI reports one message and an exit code."""

from __future__ import annotations

from ..errors import CommandError, UsageError


class ServerError(CommandError):
    """A request failed for a reason that retrying will not change (HTTP 4xx, a malformed stream)."""


class TransientServerError(ServerError):
    """A request failed for a reason that may pass: the connection dropped or was refused, HTTP 5xx or 429,
    a stream cut before its end."""


class Cancelled(CommandError):
    """The run was interrupted (Ctrl-C, SIGTERM) while the request was in flight."""

    exit_code = 130


class ServerUnreachable(TransientServerError):
    """No connection to the server at all."""


class ContextTooLong(ServerError):
    """The server refused the prompt as longer than its context (HTTP 400)."""


class ModelNotServed(UsageError):
    """The server does not serve the requested model."""


class MissingDependency(UsageError):
    """An optional package the requested feature needs is not installed."""


def require(module: str, feature: str):
    """Import ``module`` for ``feature`` or fail with the install command."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingDependency(
            f"{feature} needs the Python package {module.split('.')[0]!r} ({error}); install it with "
            "`pip install 'prefill-accel[serving]'`"
        ) from error
