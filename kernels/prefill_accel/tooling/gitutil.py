"""Thin wrapper over the git command line, with a fixed identity and clock for reproducible commits."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..errors import UsageError
from .errors import ToolingError

# Commits the tools create themselves (the offline upstream tree, overlay commits) use this identity and
# date, so the same inputs give the same commit hashes on every machine.
TOOL_IDENTITY = {
    "GIT_AUTHOR_NAME": "prefill-accel tooling",
    "GIT_AUTHOR_EMAIL": "tooling@prefill-accel.invalid",
    "GIT_COMMITTER_NAME": "prefill-accel tooling",
    "GIT_COMMITTER_EMAIL": "tooling@prefill-accel.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
_BASE_CONFIG = ["-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false",
                "-c", "advice.detachedHead=false", "-c", "init.defaultBranch=main"]


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(TOOL_IDENTITY)
    env["GIT_TERMINAL_PROMPT"] = "0"
    env.update(extra or {})
    return env


def git(*args: str, cwd: Path | None = None, check: bool = True, input: str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `git ARGS` in cwd; on failure (check=True) raise ToolingError with git's stderr.

    git runs in a session of its own, so a terminal's Ctrl-C reaches only this process, which stops
    git (an interrupted subprocess.run kills its child) or, inside a journal, lets it finish first.
    """
    if cwd is not None and not Path(cwd).is_dir():
        raise UsageError(f"{cwd} is not a directory")
    proc = subprocess.run(
        ["git", *_BASE_CONFIG, *args], cwd=cwd, input=input, capture_output=True, text=True,
        env=git_env(env), start_new_session=True,
    )
    if check and proc.returncode != 0:
        raise ToolingError(f"git {' '.join(args)} failed in {cwd}:\n{proc.stderr.strip()}")
    return proc


def is_git_tree(path: Path) -> bool:
    """True when path is the top level of a git work tree."""
    proc = git("rev-parse", "--show-toplevel", cwd=path, check=False)
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == path.resolve()


def is_clean(path: Path) -> bool:
    return not git("status", "--porcelain", "--untracked-files=no", cwd=path).stdout.strip()


def head(path: Path) -> str:
    return git("rev-parse", "HEAD", cwd=path).stdout.strip()


def commit_all(path: Path, message: str) -> str:
    """Stage everything (including deletions) and commit it with the tool identity; returns the hash."""
    git("add", "-A", ".", cwd=path)
    git("commit", "-q", "--no-verify", "--allow-empty", "-m", message, cwd=path)
    return head(path)


def source_commit(root: Path) -> str:
    """The prefill-accel commit being installed: $PREFILL_ACCEL_COMMIT, else root's HEAD, else ""."""
    if os.environ.get("PREFILL_ACCEL_COMMIT"):
        return os.environ["PREFILL_ACCEL_COMMIT"]
    proc = git("rev-parse", "HEAD", cwd=root, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def path_arg(path: Path | str) -> str:
    """A local path as a git argument that can never read as an option: absolute."""
    return str(Path(path).absolute())
