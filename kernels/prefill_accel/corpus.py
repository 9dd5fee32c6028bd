"""Real text that every machine has offline: the sources of the Python standard library.

The accuracy harness takes its natural-language prompt from here and the serving tools
(`prefill-accel bench`) build their long prompts from it: English docstrings and comments mixed with
code, the kind of text a code-base Q&A or long-document request carries. Files are read from disk, not
imported, so no module runs.
"""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path
from typing import Iterator

STDLIB_TEXT_MODULES = (
    "argparse", "dataclasses", "functools", "inspect", "json.decoder", "logging", "pathlib", "subprocess",
    "threading", "typing", "unittest.case", "email.message", "http.client", "collections", "shutil", "tarfile",
    "zipfile", "asyncio.base_events", "concurrent.futures._base", "configparser", "difflib", "pydoc",
)  # fmt: skip
"""Modules whose sources come first, in this order: the accuracy harness's fixed prompt text (for a given
Python version)."""


def _module_file(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise FileNotFoundError(f"no Python source for standard library module {name!r}")
    return Path(spec.origin)


def stdlib_sources() -> Iterator[str]:
    """The sources of :data:`STDLIB_TEXT_MODULES` in order, then of every other module file of the
    standard library, sorted by path (its test suite and installed packages left out)."""
    seen = set()
    for name in STDLIB_TEXT_MODULES:
        path = _module_file(name)
        seen.add(path)
        yield path.read_text(encoding="utf-8")
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).parts
        if path in seen or relative[0] in ("site-packages", "dist-packages", "test", "idlelib", "lib2to3"):
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
