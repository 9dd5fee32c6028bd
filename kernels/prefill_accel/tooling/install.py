"""`prefill-accel install`: patch the engine installed in a Python environment and add the runtime package.

This is the one install step both image builds run: the Dockerfiles call scripts/install-into-env.sh
inside the official image, and `build.sh --venv` calls the same script on a fresh virtualenv.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ..errors import UsageError
from ..progress import Progress
from .apply import ApplyResult, apply
from .errors import ToolingError
from .targets import Target

_FIND_PACKAGE = (
    "import importlib.util, sys; s = importlib.util.find_spec(sys.argv[1]); "
    "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')"
)


def installed_package_parent(python: str, package: str) -> Path:
    """The directory (site-packages) holding `package` in python's environment, without importing it."""
    proc = subprocess.run([python, "-c", _FIND_PACKAGE, package], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UsageError(f"cannot run {python}: {proc.stderr.strip()}")
    if not proc.stdout.strip():
        raise UsageError(f"{package} is not installed in the environment of {python}")
    return Path(proc.stdout.strip()).parent


def install(target: Target, root: Path, python: str, progress: Progress | None = None,
            runtime: bool = True) -> ApplyResult:
    """Apply series + overlay to python's installed engine, then install the runtime package (--no-deps)."""
    progress = progress or Progress()
    site = installed_package_parent(python, target.package)
    result = apply(target, site, root, progress)
    if runtime:
        with progress.step("Installing the prefill-accel runtime package"):
            proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(root)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise ToolingError(f"pip install of {root} failed:\n{proc.stderr.strip()[-2000:]}")
    return result


def patched_modules(result: ApplyResult) -> list[str]:
    """Import names of the Python modules the series and overlay changed, for an import smoke test."""
    target = result.layout.target
    return [
        rel[len(target.path_prefix):-3].replace("/", ".").removesuffix(".__init__")
        for rel in result.changed
        if rel.endswith(".py") and rel.startswith(target.package_path + "/")
    ]
