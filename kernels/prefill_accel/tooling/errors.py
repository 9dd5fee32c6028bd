"""Errors of the patch tooling, each with the process exit code the CLI returns for it.

Exit codes (documented in docs/tooling.md):
  0  success
  1  the operation failed (a download, a git command, a test run, verify found regressions)
  2  usage error: unknown target, bad arguments, missing files
  3  a patch does not apply (nothing was changed)
  4  the series is already applied (nothing was changed)
  5  overlay conflict: an overlay file would overwrite an undeclared upstream file (nothing was changed)
  6  checksum mismatch of a downloaded or cached artifact
  7  rebase stopped on a conflict (the repository is unchanged; a work tree is left to resolve)
  130 interrupted by a signal (journal.Interrupted; what apply had changed was undone)
"""

from __future__ import annotations

from ..errors import CommandError


class ToolingError(CommandError):
    """A tooling operation failed (a download, a git command, a test run)."""


class PatchDoesNotApply(ToolingError):
    exit_code = 3


class AlreadyApplied(ToolingError):
    exit_code = 4


class OverlayConflict(ToolingError):
    exit_code = 5


class ChecksumMismatch(ToolingError):
    exit_code = 6


class RebaseConflict(ToolingError):
    exit_code = 7
