"""Changes to a tree that survive being interrupted: signals held off to safe points, a journal on disk.

A change (apply's commits, apply's file writes) runs inside `Journal.open`:
  - SIGINT, SIGTERM and SIGHUP are recorded instead of acted on, and `checkpoint()` raises
    `Interrupted` between steps, so a step (one git command, one file replaced) is never cut in half;
    git children run in their own session (gitutil), so a terminal's Ctrl-C to the process group
    reaches only this process and is handled here.
  - Before the first change the journal is written to disk: what the tree was (a commit, or a
    backup of every file about to be replaced). Any exit but success rolls back from it, with the
    signals still held off, and the journal is removed only when the change is complete or undone.
  - A process killed outright (SIGKILL, power loss) leaves the journal behind; the next run finds it
    with `Journal.recover` and restores the tree from it before doing anything else, so a rerun
    starts from the tree as it was and finishes the change, never guessing from a half-done one.
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import shutil
import signal
import threading
from pathlib import Path

from . import gitutil
from .errors import ToolingError

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
JOURNAL_NAME = "prefill-accel-apply.json"
TMP_SUFFIX = ".prefill-accel-tmp"


class Interrupted(ToolingError):
    """A signal stopped the operation at a safe point; what it had changed was undone."""

    exit_code = 130


class _HeldSignals:
    """Records the held signals while active (main thread only: Python delivers signals nowhere else)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_HeldSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in HELD_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (nohup, a background job) stays so
                    self._previous[sig] = signal.signal(sig, lambda number, frame: self.received.append(number))
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def redeliver(self) -> None:
        """Act on a signal that came after the last checkpoint, now that the default handlers are back."""
        if self.received:
            signal.raise_signal(self.received[0])


class Journal:
    """One change to a tree, undone on any exit but success. Subclasses know what the tree is."""

    def __init__(self, path: Path):
        self.path = path
        self.signals = _HeldSignals()

    def checkpoint(self) -> None:
        if self.signals.received:
            name = signal.Signals(self.signals.received[0]).name
            raise Interrupted(f"{name} received")

    def record(self) -> dict:
        raise NotImplementedError

    def rollback(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """The change is complete: forget how to undo it."""
        self.path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def open(self):
        """Hold signals, write the journal, yield; roll back on any exception, keep the change otherwise."""
        with self.signals:
            try:
                _write_json(self.path, self.record())
            except OSError as error:
                raise ToolingError(f"cannot write the journal {self.path} ({error}); nothing was changed") from None
            try:
                yield self
                self.checkpoint()
            except BaseException as error:
                undone = self._rollback_reporting()
                if isinstance(error, OSError):
                    raise ToolingError(f"{error}; {undone}") from None
                if isinstance(error, ToolingError):
                    error.args = (f"{error}; {undone}",)
                raise
            self.finish()
        self.signals.redeliver()

    def _rollback_reporting(self) -> str:
        """Roll back and say how it went: a failure of the rollback is reported beside the original error,
        never instead of it."""
        try:
            self.rollback()
        except (OSError, ToolingError) as error:
            return (f"undoing the change failed too ({error}); the journal {self.path} is kept, so the next "
                    "run of the same command restores the tree first")
        return "everything this run changed was undone"


class GitJournal(Journal):
    """A git work tree: the commit it was at and the untracked files the change may create."""

    def __init__(self, root: Path, creates: list[str]):
        super().__init__(root / ".git" / JOURNAL_NAME)
        self.root = root
        self.start = gitutil.head(root)
        self.creates = creates

    def record(self) -> dict:
        return {"kind": "git", "start": self.start, "creates": self.creates}

    def rollback(self) -> None:
        restore_git(self.root, self.start, self.creates)
        self.path.unlink(missing_ok=True)


def restore_git(root: Path, start: str, creates: list[str]) -> None:
    """The work tree back at commit `start`: a `git am` in progress aborted, staged changes dropped,
    created files that `start` does not track removed."""
    if (root / ".git" / "rebase-apply").exists():
        gitutil.git("am", "--abort", cwd=root, check=False)
    gitutil.git("reset", "-q", "--hard", start, cwd=root)
    for rel in creates:
        if gitutil.git("cat-file", "-e", f"{start}:{rel}", cwd=root, check=False).returncode:
            (root / rel).unlink(missing_ok=True)


class FileJournal(Journal):
    """Files replaced in a directory (an installed package): each original kept as a backup first."""

    def __init__(self, root: Path, name: str, paths: list[Path]):
        self.backups = root / f".prefill-accel-apply-{name}"
        super().__init__(self.backups / "journal.json")
        self.root = root
        self.paths = paths
        self.entries: list[dict] = []

    def record(self) -> dict:
        # Backups are made before the journal names them, so a journal on disk always has its backups.
        shutil.rmtree(self.backups, ignore_errors=True)
        self.backups.mkdir()
        for number, path in enumerate(self.paths):
            backup = None
            if path.exists():
                backup = str(number)
                _link_or_copy(path, self.backups / backup)
            self.entries.append({"path": path.relative_to(self.root).as_posix(), "backup": backup})
        return {"kind": "files", "entries": self.entries}

    def rollback(self) -> None:
        restore_files(self.root, self.backups, self.entries)

    def finish(self) -> None:
        shutil.rmtree(self.backups)


def restore_files(root: Path, backups: Path, entries: list[dict]) -> None:
    """Every journalled file back as it was (absent ones removed), temporary files cleared, backups dropped.
    A file the change never got to is left alone: it may sit where nothing can be written."""
    for entry in entries:
        path = root / entry["path"]
        tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
        if tmp.exists():
            tmp.unlink()
        backup = backups / entry["backup"] if entry["backup"] is not None else None
        if backup is None:
            if path.exists():
                path.unlink()
        elif backup.exists() and not _same_file(path, backup):
            os.replace(backup, path)
    shutil.rmtree(backups)


def _same_file(path: Path, backup: Path) -> bool:
    try:
        return os.path.samefile(path, backup) or filecmp.cmp(path, backup, shallow=False)
    except FileNotFoundError:
        return False


def write_file(path: Path, data: bytes | None) -> None:
    """Replace path by data in one rename (None deletes it); no temporary file is left on failure."""
    if data is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def recover(root: Path, git_tree: bool, name: str) -> str | None:
    """Undo a change an earlier run left half done (its journal is on disk); returns what was done, or None."""
    if git_tree:
        path = root / ".git" / JOURNAL_NAME
        if not path.is_file():
            return None
        record = _read_json(path)
        restore_git(root, record["start"], record["creates"])
        path.unlink()
        return f"an interrupted apply was rolled back: {root} is back at {record['start'][:12]}"
    backups = root / f".prefill-accel-apply-{name}"
    if not backups.is_dir():
        return None
    journal = backups / "journal.json"
    if not journal.is_file():  # killed while making the backups: nothing was replaced yet
        shutil.rmtree(backups)
        return None
    entries = _read_json(journal)["entries"]
    restore_files(root, backups, entries)
    return f"an interrupted apply was rolled back: {len(entries)} file(s) in {root} restored"


def _link_or_copy(source: Path, dest: Path) -> None:
    """Keep the original file: a hard link costs nothing, since the change replaces files by rename."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ToolingError(f"the journal {path} of an interrupted apply cannot be read ({error}); "
                           "restore the tree by hand or start from a fresh one") from None
