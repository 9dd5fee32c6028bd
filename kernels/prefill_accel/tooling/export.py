"""`edit` a target's series as git commits, and `export` those commits back to patches/, deterministically.

Export writes `NNNN-topic.patch` files with `git format-patch` and then removes everything that would
churn between exports of the same commits: the commit hash on the From line (--zero-commit), the git
version signature (--no-signature), abbreviated blob ids (--full-index) and the author date (set to a
fixed date; the author's name stays). So a diff of patches/ in review shows only real changes.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from . import gitutil
from .apply import GENERATED_TRAILER, apply
from .errors import UsageError
from .fetch import fetch
from .progress import Progress
from .series import SERIES_FILE
from .targets import Target

FIXED_DATE = "Sat, 1 Jan 2000 00:00:00 +0000"
_DATE_RE = re.compile(r"^Date: .*$", re.MULTILINE)


def default_work_tree(target: Target, root: Path) -> Path:
    return root / "build" / "edit" / target.name


def edit(target: Target, dest: Path, root: Path, progress: Progress | None = None) -> Path:
    """A fresh upstream clone at the tag with the series applied as commits (no overlay)."""
    progress = progress or Progress()
    fetch(target, dest, root, progress)
    apply(target, dest, root, progress, with_overlay=False)
    return dest


def series_commits(tree: Path, base: str) -> list[str]:
    """Commits from base to HEAD, oldest first, without the tool's generated overlay commits."""
    commits = gitutil.git("rev-list", "--reverse", f"{base}..HEAD", cwd=tree).stdout.split()
    return [c for c in commits
            if GENERATED_TRAILER not in gitutil.git("log", "-1", "--format=%B", c, cwd=tree).stdout]


def format_patch(tree: Path, commit: str, number: int, out: Path) -> Path:
    """One commit as a normalized `NNNN-topic.patch` in out."""
    name = gitutil.git("format-patch", "-1", "-N", "--zero-commit", "--no-signature", "--full-index",
                       "--no-renames", "--start-number", str(number), "-o", str(out), commit,
                       cwd=tree).stdout.strip()
    path = Path(name)
    text = _DATE_RE.sub(f"Date: {FIXED_DATE}", path.read_text(encoding="utf-8"), count=1)
    path.write_text(text, encoding="utf-8")
    return path


def export(target: Target, tree: Path, root: Path, dest: Path | None = None,
           progress: Progress | None = None) -> list[str]:
    """Regenerate the quilt directory (default patches/<engine>/<version>/) from tree's commits."""
    progress = progress or Progress()
    dest = dest or target.patch_dir(root)
    if not gitutil.is_git_tree(tree):
        raise UsageError(f"{tree} is not a git work tree; create one with `prefill-accel edit {target.name}`")
    if not gitutil.is_clean(tree):
        raise UsageError(f"{tree} has uncommitted changes; commit them (one commit per patch) first")
    commits = series_commits(tree, target.git_tag)
    with tempfile.TemporaryDirectory(prefix="prefill-accel-export-") as tmp, \
            progress.step(f"Exporting {len(commits)} commit(s) to {dest}"):
        names = [format_patch(tree, c, i, Path(tmp)).name for i, c in enumerate(commits, start=1)]
        dest.mkdir(parents=True, exist_ok=True)
        for old in dest.glob("*.patch"):
            old.unlink()
        for name in names:
            (dest / name).write_bytes((Path(tmp) / name).read_bytes())
        (dest / SERIES_FILE).write_text("".join(f"{n}\n" for n in names))
    return names
