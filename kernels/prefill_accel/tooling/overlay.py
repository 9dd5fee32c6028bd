"""The overlay tree (overlay/<engine>/<version>/): files copied into the engine beside the patches.

Overlay paths are upstream-tree-relative, like patch paths: overlay/sglang/0.5.16/python/sglang/... lands
at python/sglang/... in a git tree and at sglang/... in site-packages (the target's path prefix is
stripped). Files outside the package (upstream's tests/ or test/ directories, for our own tests of the
patched engine) land only in git trees.

An overlay file must not silently replace an upstream file: a replacement has to be listed in the
target's `overlay_replaces`.
"""

from __future__ import annotations

from pathlib import Path

from .errors import OverlayConflict
from .targets import Target


def overlay_files(target: Target, root: Path) -> dict[str, Path]:
    """Tree-relative path -> source file, for every file of the target's overlay."""
    base = target.overlay_dir(root)
    if not base.is_dir():
        return {}
    return {
        p.relative_to(base).as_posix(): p
        for p in sorted(base.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def check_no_silent_replacement(target: Target, files: dict[str, Path], exists) -> None:
    """Raise OverlayConflict naming every overlay file that would replace an undeclared upstream file.

    `exists(tree_relative_path)` tells whether the unpatched target already has that file.
    """
    clashes = [rel for rel in files if exists(rel) and rel not in target.overlay_replaces]
    if clashes:
        raise OverlayConflict(
            f"overlay for {target.name} would overwrite upstream file(s): {', '.join(sorted(clashes))}. "
            "If the replacement is deliberate, list them in overlay_replaces in patches/targets.toml; "
            "otherwise rename the overlay file."
        )
