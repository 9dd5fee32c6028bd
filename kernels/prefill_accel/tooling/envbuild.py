"""`prefill-accel build --venv`: the patched engine as a virtualenv, the flavour of the image build without one.

Both flavours end in the same install step, scripts/install-into-env.sh (-> `prefill-accel install`):
  image  docker/Dockerfile.<engine>, FROM the target's official image, runs the script inside it (images.py)
  venv   a fresh virtualenv with the pinned engine wheel installed --no-deps, the pinned CPU import/test
         dependencies (docker/requirements/), the target's CPU-breaking files removed, then the script;
         with --gpu the pinned engine wheel with the dependencies its metadata pins (torch with its CUDA
         libraries, Triton, the engine's CUDA kernels), as the official image installs it, then the script

The same virtualenv without the install step is `verify`'s cached test environment (cached_test_env).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import UsageError
from ..progress import Progress
from . import registry
from .errors import ToolingError
from .overlay import overlay_files
from .series import Series, content_hash
from .targets import Target

INSTALL_SCRIPT = Path("scripts") / "install-into-env.sh"
ENV_STAMP = "prefill-accel-env.json"


def series_hash(target: Target, root: Path) -> str:
    return content_hash(Series(target.patch_dir(root)), overlay_files(target, root))


def build_venv(target: Target, root: Path, venv: Path, progress: Progress, gpu: bool = False) -> Path:
    """A virtualenv holding the patched engine, runnable on a GPU with ``gpu`` (else it imports and
    runs its CPU tests only); returns its python."""
    if venv.exists() and any(venv.iterdir()):
        raise UsageError(f"{venv} exists and is not empty; pass a new directory to --venv")
    python = _gpu_engine_venv(target, root, venv, progress) if gpu else _engine_venv(target, root, venv, progress)
    with progress.step(f"Running {INSTALL_SCRIPT} (the image's install step)"):
        env = dict(os.environ, PREFILL_ACCEL_TOOL_PYTHON=sys.executable)
        _run(["bash", str(root / INSTALL_SCRIPT), target.name, "--python", str(python)], env=env)
    if gpu:
        for warning in first_use_import_failures(target, python):
            progress.note(f"warning: {warning}")
    return python


def first_use_import_failures(target: Target, python: Path) -> list[str]:
    """One line for each of the target's gpu_first_use_imports that the environment's python cannot import:
    the module, its error, and the feature that would fail on first use instead of at startup."""
    failures = []
    for entry in target.gpu_first_use_imports:
        module, _, feature = entry.partition(" ")
        try:
            _run([str(python), "-c", f"import {module}"])
        except ToolingError as error:
            failures.append(f"`import {module}` fails in this environment ({str(error).splitlines()[-1]}): "
                            f"{feature} fails when first used")  # fmt: skip
    return failures


def cached_test_env(target: Target, root: Path, progress: Progress) -> Path:
    """The cached environment `verify` runs upstream's tests with; returns its python.

    $PREFILL_ACCEL_CACHE/envs/TARGET: the pinned CPU requirements and the unpatched engine wheel, built on
    first use and again whenever those inputs change (recorded in its ENV_STAMP, written last).
    """
    venv = registry.cache_dir(root) / "envs" / target.name
    key = _test_env_key(target, root)
    stamp = venv / ENV_STAMP
    with _locked(venv.with_name(f"{venv.name}.lock")):
        if stamp.is_file() and json.loads(stamp.read_text()) == key:
            progress.note(f"    using the cached test environment {venv}")
            return venv / "bin" / "python"
        shutil.rmtree(venv, ignore_errors=True)
        python = _engine_venv(target, root, venv, progress)
        stamp.write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")
    return python


def _test_env_key(target: Target, root: Path) -> dict:
    requirements = root / target.venv_requirements
    return {
        "target": target.name,
        "python": sys.version.split()[0],
        "requirements_sha256": registry.sha256_of(requirements) if requirements.is_file() else "",
        "wheel_sha256": target.wheel_sha256,
        "venv_remove": list(target.venv_remove),
    }


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on path for the block: two verify runs never build one environment at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _engine_venv(target: Target, root: Path, venv: Path, progress: Progress) -> Path:
    """A virtualenv with the pinned CPU requirements and the engine wheel (--no-deps), CPU-breaking files
    removed, not yet patched; returns its python."""
    requirements = root / target.venv_requirements
    if not requirements.is_file():
        raise UsageError(f"{target.name}: no venv requirements file {requirements}")
    python = venv / "bin" / "python"
    with progress.step(f"Creating virtualenv {venv}"):
        _create_venv(venv)
    with progress.step(f"Installing pinned CPU dependencies ({requirements.name})"):
        _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-r", str(requirements)])
    wheel = registry.fetch_file(target.engine, target.wheel, target.wheel_sha256, root, progress)
    with progress.step(f"Installing {wheel.name} (--no-deps)"):
        _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)])
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    remove_cpu_breaking_files(target, site)
    return python


def _gpu_engine_venv(target: Target, root: Path, venv: Path, progress: Progress) -> Path:
    """A virtualenv with the pinned engine wheel for its Python (Target.wheel_for) and the dependencies pip
    resolves from its metadata (for vLLM 0.6.3.post1: torch 2.4.0 with its CUDA 12 libraries, Triton 3.0.0,
    xformers), the install the official image is built from, its open-ended requirements held by the
    target's gpu_constraints; not yet patched. Returns its python."""
    python = venv / "bin" / "python"
    with progress.step(f"Creating virtualenv {venv}"):
        _create_venv(venv)
    held = []
    if target.gpu_constraints:
        constraints = venv / "prefill-accel-constraints.txt"
        constraints.write_text("\n".join(target.gpu_constraints) + "\n")
        held = ["-c", str(constraints)]
    name, sha256 = target.wheel_for(_python_tag(python))
    wheel = registry.fetch_file(target.engine, name, sha256, root, progress)
    pinned = f"its pinned dependencies (torch {target.torch} and its CUDA libraries)"
    with progress.step(f"Installing {wheel.name} with {pinned}"):
        _run([str(python), "-m", "pip", "install", "-q", *held, str(wheel)])
    return python


def _create_venv(venv: Path) -> None:
    """A virtualenv with pip. An interpreter whose standard library cannot seed pip (no ensurepip, or
    Debian's without python3-venv) gets the virtualenv without pip, then pip installed into it by this
    interpreter's own pip (``pip --python``), from the index or the wheels PIP_FIND_LINKS names."""
    try:
        _run([sys.executable, "-m", "venv", str(venv)])
        return
    except ToolingError as error:
        if "ensurepip" not in str(error):
            raise
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "pip"])


def _python_tag(python: Path) -> str:
    """The CPython wheel tag of an interpreter, e.g. "cp312"."""
    return _run([str(python), "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"]).strip()


def gpu_listed() -> bool:
    """Whether nvidia-smi lists a GPU on this machine."""
    if shutil.which("nvidia-smi") is None:
        return False
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return proc.returncode == 0 and proc.stdout.lstrip().startswith("GPU ")


def remove_cpu_breaking_files(target: Target, site: Path) -> None:
    """Delete the target's venv_remove files (package-relative) from a directory holding the package."""
    for rel in target.venv_remove:
        (site / rel).unlink(missing_ok=True)


def _run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()
        raise ToolingError(f"{' '.join(cmd[:6])} ... failed (exit {proc.returncode}):\n{output[-3000:]}")
    return proc.stdout
