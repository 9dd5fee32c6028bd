"""A quilt patch directory (patches/<engine>/<version>/): the series file, each patch's files and hunks.

Patches are `git format-patch` files; paths inside them are upstream-tree-relative (a/vllm/...,
a/python/sglang/...). Parsing is only as deep as the tools need: which files a patch touches and where
each hunk starts, so an error can name the patch, the file and the hunk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

from ..errors import UsageError

SERIES_FILE = "series"
_DIFF_RE = re.compile(r"^diff --git a/(?P<old>\S+) b/(?P<new>\S+)$")
_HUNK_RE = re.compile(r"^@@ -(?P<old>\d+)(?:,(?P<oldlen>\d+))? \+(?P<new>\d+)(?:,(?P<newlen>\d+))? @@(?P<ctx>.*)$")


@dataclasses.dataclass(frozen=True)
class Hunk:
    number: int  # 1-based within its file
    old_start: int
    header: str  # the @@ line

    def describe(self) -> str:
        return f"hunk #{self.number} ({self.header})"


@dataclasses.dataclass
class FileDiff:
    old_path: str | None  # None for a created file
    new_path: str | None  # None for a deleted file
    hunks: list[Hunk] = dataclasses.field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path  # type: ignore[return-value]

    def hunk_at(self, old_line: int) -> Hunk | None:
        """The hunk git reports as failing at old_line (git names a hunk by its old start line)."""
        for hunk in self.hunks:
            if hunk.old_start == old_line:
                return hunk
        return None


@dataclasses.dataclass
class Patch:
    name: str
    path: Path
    files: list[FileDiff]

    @property
    def paths(self) -> set[str]:
        """Every tree-relative path the patch reads or writes."""
        return {p for f in self.files for p in (f.old_path, f.new_path) if p}

    def file(self, path: str) -> FileDiff | None:
        for f in self.files:
            if path in (f.old_path, f.new_path):
                return f
        return None


def parse_patch(path: Path) -> Patch:
    files: list[FileDiff] = []
    current: FileDiff | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if m := _DIFF_RE.match(line):
            current = FileDiff(m["old"], m["new"])
            files.append(current)
        elif current is None:
            continue
        elif line.startswith("--- ") and not current.hunks:
            current.old_path = None if line == "--- /dev/null" else line[6:]
        elif line.startswith("+++ ") and not current.hunks:
            current.new_path = None if line == "+++ /dev/null" else line[6:]
        elif line.startswith("new file mode"):
            current.old_path = None
        elif line.startswith("deleted file mode"):
            current.new_path = None
        elif m := _HUNK_RE.match(line):
            current.hunks.append(Hunk(len(current.hunks) + 1, int(m["old"]), line))
    if not files:
        raise UsageError(f"{path}: not a git patch (no 'diff --git' lines)")
    return Patch(path.name, path, files)


class Series:
    """The ordered patches of one quilt directory; an absent directory is an empty series."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.patches: list[Patch] = []
        series_file = directory / SERIES_FILE
        if not series_file.is_file():
            return
        for raw in series_file.read_text().splitlines():
            name = raw.split("#", 1)[0].strip()
            if not name:
                continue
            patch_path = directory / name
            if not patch_path.is_file():
                raise UsageError(f"{series_file} lists {name}, which does not exist")
            self.patches.append(parse_patch(patch_path))

    def __iter__(self):
        return iter(self.patches)

    def __len__(self) -> int:
        return len(self.patches)

    @property
    def paths(self) -> set[str]:
        return {p for patch in self.patches for p in patch.paths}


def content_hash(series: Series, overlay_files: dict[str, Path]) -> str:
    """12 hex digits of sha256 over the series file, each patch and each overlay file (path and bytes).

    This is the "series hash" the startup log, the build stamp and the image labels report: it changes
    exactly when what gets applied to the engine changes.
    """
    digest = hashlib.sha256()
    series_file = series.directory / SERIES_FILE
    digest.update(series_file.read_bytes() if series_file.is_file() else b"")
    for patch in series:
        digest.update(b"\0patch\0" + patch.name.encode() + b"\0" + patch.path.read_bytes())
    for rel in sorted(overlay_files):
        digest.update(b"\0overlay\0" + rel.encode() + b"\0" + overlay_files[rel].read_bytes())
    return digest.hexdigest()[:12]
