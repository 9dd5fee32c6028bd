"""Atomic application of a target's patch series and overlay to a git tree or an installed package.

Every patch is first applied, in order, to a scratch copy of the files the series touches; only when the
whole series goes through is the real target changed. A failure therefore leaves the target exactly as
it was, and the error names the patch, the file and the hunk.

Two kinds of target directory:
  git tree   the upstream repository (from `fetch`): patches become commits via `git am`; the overlay
             and the build stamp are one more commit marked `Prefill-Accel-Generated: overlay`
  installed  a directory holding the installed package (site-packages): the path prefix is stripped,
             patch hunks and overlay files outside the package are skipped, files are replaced with
             backups and restored on any error

Either change runs under a journal (journal.py): a signal or an error undoes it before the command
exits, and a run killed outright is undone by the next apply before it starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..engine.banner import STAMP_NAME
from ..errors import UsageError
from ..progress import Progress
from . import gitutil, journal
from .errors import AlreadyApplied, PatchDoesNotApply, ToolingError
from .journal import FileJournal, GitJournal
from .overlay import check_no_silent_replacement, overlay_files
from .series import Patch, Series, content_hash
from .targets import Target

GENERATED_TRAILER = "Prefill-Accel-Generated: overlay"
_FAILED_AT_RE = re.compile(r"^error: patch failed: (?P<file>.+):(?P<line>\d+)$")
_FILE_ERROR_RE = re.compile(r"^error: (?P<file>[^:]+): (?P<why>.+)$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where tree-relative paths land in the directory being patched."""

    target: Target
    root: Path
    kind: str  # "git" or "installed"

    def local(self, rel: str) -> Path | None:
        """The on-disk path of a tree-relative path, or None if it does not land in this directory."""
        if self.kind == "git":
            return self.root / rel
        if not rel.startswith(self.target.package_path + "/"):
            return None
        return self.root / rel[len(self.target.path_prefix):]

    @property
    def stamp_rel(self) -> str:
        return f"{self.target.package_path}/{STAMP_NAME}"


@dataclasses.dataclass
class ApplyResult:
    layout: Layout
    patches: list[str]
    overlay: list[str]
    series_hash: str
    stamp: dict
    changed: list[str]  # tree-relative paths the series or overlay touched that land in this directory


def detect_layout(target: Target, tree: Path) -> Layout:
    tree = Path(tree).resolve()
    if not tree.is_dir():
        raise UsageError(f"{tree} is not a directory")
    if (tree / target.package_path).is_dir() and gitutil.is_git_tree(tree):
        return Layout(target, tree, "git")
    if (tree / target.package / "__init__.py").is_file():
        return Layout(target, tree, "installed")
    if tree.name == target.package and (tree / "__init__.py").is_file():
        raise UsageError(f"{tree} is the package itself; pass the directory that contains it ({tree.parent})")
    raise UsageError(
        f"{tree} is neither a git tree of {target.name} (no {target.package_path}/) nor a directory "
        f"holding an installed {target.package} package"
    )


def read_stamp(layout: Layout) -> dict | None:
    path = layout.local(layout.stamp_rel)
    return json.loads(path.read_text()) if path and path.is_file() else None


def build_stamp(target: Target, series: Series, series_hash: str, root: Path) -> dict:
    """What the patched engine reports at startup and the image labels carry."""
    return {
        "target": target.name,
        "series_version": target.series_version,
        "series_hash": series_hash,
        "patches": [p.name for p in series],
        "prefill_accel_commit": gitutil.source_commit(root),
    }


def apply(target: Target, tree: Path, root: Path, progress: Progress | None = None,
          with_overlay: bool = True) -> ApplyResult:
    """Apply the whole series (and overlay) to tree, or change nothing and raise.

    Interrupted by a signal, it undoes what it changed before exiting; killed outright, it leaves a
    journal from which the next apply restores the tree first (prefill_accel.tooling.journal).
    """
    progress = progress or Progress()
    layout = detect_layout(target, tree)
    _check_writable(layout)
    recovered = journal.recover(layout.root, layout.kind == "git", target.package)
    if recovered:
        progress.note(f"    {recovered}")
    series = Series(target.patch_dir(root))
    overlay = overlay_files(target, root) if with_overlay else {}
    series_hash = content_hash(series, overlay_files(target, root))
    stamp = read_stamp(layout)
    if stamp is not None:
        raise AlreadyApplied(
            f"{layout.root} already carries the prefill-accel series for {stamp.get('target')} "
            f"(hash {stamp.get('series_hash')}, {layout.stamp_rel}); start from a fresh tree to re-apply"
        )
    if layout.kind == "git" and not gitutil.is_clean(layout.root):
        raise UsageError(f"{layout.root} has uncommitted changes; commit or stash them first")

    with tempfile.TemporaryDirectory(prefix="prefill-accel-apply-") as tmp:
        stage = Path(tmp)
        with progress.step(f"Dry run: {len(series)} patch(es) of {target.name} against {layout.root}"):
            _dry_run(layout, series, stage)
        placed = {rel: src for rel, src in overlay.items() if layout.local(rel) is not None}
        check_no_silent_replacement(
            target, placed, lambda rel: layout.local(rel).exists() or _created_by(series, rel))
        new_stamp = build_stamp(target, series, series_hash, root)
        if layout.kind == "git":
            _commit_to_git(layout, series, placed, new_stamp, with_overlay, progress)
        else:
            _write_installed(layout, series, stage, placed, new_stamp, progress)
    changed = sorted({rel for rel in series.paths if layout.local(rel) is not None} | set(placed))
    return ApplyResult(layout, [p.name for p in series], sorted(placed), series_hash, new_stamp, changed)


def _check_writable(layout: Layout) -> None:
    """A usage error before anything is tried when the tree cannot be changed at all."""
    package = layout.root / (layout.target.package_path if layout.kind == "git" else layout.target.package)
    places = [layout.root, package] + ([layout.root / ".git"] if layout.kind == "git" else [])
    for place in places:
        if not os.access(place, os.W_OK | os.X_OK):
            raise UsageError(f"{place} is not writable; apply needs to change files there (nothing was changed)")


def _created_by(series: Series, rel: str) -> bool:
    return any(f.old_path is None and f.new_path == rel for patch in series for f in patch.files)


def _init_stage(layout: Layout, series: Series, stage: Path) -> None:
    """Copy every file the series touches into stage (tree-relative), as a git work tree for `git apply`."""
    gitutil.git("init", "-q", str(stage))
    for rel in series.paths:
        src = layout.local(rel)
        if src is not None and src.is_file():
            dest = stage / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)


def _git_apply(layout: Layout, patch: Patch, stage: Path, reverse: bool = False) -> subprocess.CompletedProcess:
    args = ["apply", "-p1", "--whitespace=nowarn"]
    if reverse:
        args.append("-R")
    if layout.kind == "installed":
        args.append(f"--include={layout.target.package_path}/*")
    return gitutil.git(*args, str(patch.path), cwd=stage, check=False)


def _dry_run(layout: Layout, series: Series, stage: Path) -> None:
    _init_stage(layout, series, stage)
    for patch in series:
        proc = _git_apply(layout, patch, stage)
        if proc.returncode != 0:
            applied = _applied_prefix(layout, series)
            if applied == len(series):
                raise AlreadyApplied(
                    f"every patch of the {layout.target.name} series is already applied to {layout.root}; "
                    "nothing was changed")
            message = describe_failure(patch, proc.stderr, layout)
            if applied:
                message += (f"\nThe first {applied} patch(es) (up to {series.patches[applied - 1].name}) "
                            "appear to be applied already: the tree is partially patched.")
            raise PatchDoesNotApply(message)


def _applied_prefix(layout: Layout, series: Series) -> int:
    """How many leading patches of the series are already in the target (reverse-apply cleanly)."""
    for count in range(len(series), 0, -1):
        with tempfile.TemporaryDirectory(prefix="prefill-accel-reverse-") as tmp:
            stage = Path(tmp)
            _init_stage(layout, series, stage)
            if all(_git_apply(layout, patch, stage, reverse=True).returncode == 0
                   for patch in reversed(series.patches[:count])):
                return count
    return 0


def describe_failure(patch: Patch, stderr: str, layout: Layout) -> str:
    """`NNNN-x.patch: path: hunk #k (@@ ... @@) does not apply`, plus git's own words."""
    lines = [f"{patch.name} does not apply to {layout.root} (nothing was changed):"]
    for raw in stderr.splitlines():
        if m := _FAILED_AT_RE.match(raw):
            diff = patch.file(m["file"])
            hunk = diff.hunk_at(int(m["line"])) if diff else None
            where = hunk.describe() if hunk else f"the hunk at line {m['line']}"
            lines.append(f"  {m['file']}: {where} does not match the file")
        elif (m := _FILE_ERROR_RE.match(raw)) and "patch does not apply" not in raw:
            lines.append(f"  {m['file']}: {m['why']}")
    lines.append("git apply said:\n    " + "\n    ".join(stderr.strip().splitlines()))
    return "\n".join(lines)


def _stamp_text(stamp: dict) -> str:
    return json.dumps(stamp, indent=2, sort_keys=True) + "\n"


def _commit_to_git(layout: Layout, series: Series, placed: dict[str, Path], stamp: dict,
                   with_overlay: bool, progress: Progress) -> None:
    creates = [*placed, layout.stamp_rel] if with_overlay else []
    with GitJournal(layout.root, creates).open() as change:
        if series.patches:
            with progress.step(f"git am {len(series)} patch(es)"):
                gitutil.git("am", "-q", "--no-3way", *[str(p.path) for p in series], cwd=layout.root)
        change.checkpoint()
        if with_overlay:
            with progress.step(f"Placing {len(placed)} overlay file(s) and the build stamp"):
                for rel, src in placed.items():
                    dest = layout.root / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dest)
                change.checkpoint()
                (layout.root / layout.stamp_rel).write_text(_stamp_text(stamp))
                gitutil.git("add", "--", *placed, layout.stamp_rel, cwd=layout.root)
                change.checkpoint()
                gitutil.git("commit", "-q", "--no-verify", "-m",
                            f"prefill-accel: overlay and build stamp for {layout.target.name}\n\n"
                            f"Series hash {stamp['series_hash']}.\n\n{GENERATED_TRAILER}",
                            cwd=layout.root)


def _write_installed(layout: Layout, series: Series, stage: Path, placed: dict[str, Path], stamp: dict,
                     progress: Progress) -> None:
    """Replace files in the installed package from stage and overlay, all or nothing."""
    writes: dict[Path, bytes | None] = {}  # None = delete
    for rel in series.paths:
        dest = layout.local(rel)
        if dest is None:
            continue
        staged = stage / rel
        if staged.is_file():
            writes[dest] = staged.read_bytes()
        elif dest.exists():
            writes[dest] = None
    for rel, src in placed.items():
        writes[layout.local(rel)] = src.read_bytes()
    writes[layout.local(layout.stamp_rel)] = _stamp_text(stamp).encode()  # last: it marks the series applied

    with progress.step(f"Writing {len(writes)} file(s) into {layout.root}"):
        with FileJournal(layout.root, layout.target.package, list(writes)).open() as change:
            for dest, data in writes.items():
                change.checkpoint()
                try:
                    journal.write_file(dest, data)
                except OSError as error:
                    raise ToolingError(f"writing {dest} failed ({error})") from None
