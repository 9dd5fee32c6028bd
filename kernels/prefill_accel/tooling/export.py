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

from ..errors import UsageError
from ..progress import Progress
from . import gitutil, journal
from .apply import GENERATED_TRAILER, apply
from .fetch import fetch
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
    """Regenerate the quilt directory (default patches/<engine>/<version>/) from tree's commits.

    The tree must carry a series: commits on top of the target's tag. The new patches are written
    beside the old ones and moved in one by one, the series file last, so an interrupted export
    leaves the old series or a mix that a rerun of the same export completes.
    """
    progress = progress or Progress()
    dest = dest or target.patch_dir(root)
    if not Path(tree).is_dir():
        raise UsageError(f"{tree} does not exist; create an edit tree with `prefill-accel edit {target.name}`")
    if not gitutil.is_git_tree(tree):
        raise UsageError(f"{tree} is not a git work tree; create one with `prefill-accel edit {target.name}`")
    if not gitutil.is_clean(tree):
        raise UsageError(f"{tree} has uncommitted changes; commit them (one commit per patch) first")
    base = f"refs/tags/{target.git_tag}"
    if gitutil.git("merge-base", "--is-ancestor", base, "HEAD", cwd=tree, check=False).returncode:
        raise UsageError(f"{tree} is not built on {target.name}'s tag {target.git_tag}; export it to the target "
                         "it was made for, or create a tree with `prefill-accel edit`")
    commits = series_commits(tree, base)
    if not commits:
        raise UsageError(f"{tree} has no commits on top of {target.git_tag}: it does not carry the series, and "
                         f"exporting it would empty {dest}. Create the tree with `prefill-accel edit {target.name}`")
    with tempfile.TemporaryDirectory(prefix="prefill-accel-export-") as tmp, \
            progress.step(f"Exporting {len(commits)} commit(s) to {dest}"):
        names = [format_patch(tree, c, i, Path(tmp)).name for i, c in enumerate(commits, start=1)]
        dest.mkdir(parents=True, exist_ok=True)
        for name in names:
            journal.write_file(dest / name, (Path(tmp) / name).read_bytes())
        for old in dest.glob("*.patch"):
            if old.name not in names:
                old.unlink()
        journal.write_file(dest / SERIES_FILE, "".join(f"{n}\n" for n in names).encode())
    return names
