"""The upstream tree of a target at its pinned tag, as a git repository.

Two sources, tried in order (or forced with $PREFILL_ACCEL_FETCH=git|artifact):
  git       `git clone --branch TAG` of the upstream repository, checked against `git_commit` if recorded
  artifact  the registry's sdist (which carries upstream's tests) or, for an engine without one, the
            wheel's Python sources placed under the package's path prefix; checksum-verified, unpacked
            into a fresh repository with one commit tagged like upstream

Either way the pristine repository is kept in the cache (trees/NAME.git) and each fetch is a cheap local
clone of it, so the same inputs give the same commit hashes everywhere.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path

from . import gitutil, registry
from .errors import ChecksumMismatch, ToolingError, UsageError
from .progress import Progress
from .targets import Target

FETCH_ENV = "PREFILL_ACCEL_FETCH"
GIT_TIMEOUT_ENV = "GIT_HTTP_LOW_SPEED_TIME"


def fetch(target: Target, dest: Path, root: Path, progress: Progress | None = None) -> Path:
    """Clone the target's upstream tree at its tag into dest (a new directory); returns dest."""
    progress = progress or Progress()
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"{dest} exists and is not empty; fetch needs a new directory")
    pristine = pristine_repo(target, root, progress)
    with progress.step(f"Cloning {target.name} into {dest}"):
        gitutil.git("clone", "-q", "--branch", target.git_tag, str(pristine), str(dest))
        gitutil.git("switch", "-q", "-c", f"prefill-accel/{target.name}", cwd=dest)
    return dest


def pristine_repo(target: Target, root: Path, progress: Progress) -> Path:
    """The cached bare repository holding the target's upstream tag, created on first use."""
    path = registry.cache_dir(root) / "trees" / f"{target.name}.git"
    if path.is_dir() and gitutil.git("rev-parse", "-q", "--verify", f"refs/tags/{target.git_tag}",
                                     cwd=path, check=False).returncode == 0:
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = os.environ.get(FETCH_ENV, "auto")
    if mode not in {"auto", "git", "artifact"}:
        raise UsageError(f"${FETCH_ENV} must be auto, git or artifact, not {mode!r}")
    if mode in {"auto", "git"}:
        with progress.step(f"Cloning {target.git_url} at {target.git_tag}"):
            ok = _clone_upstream(target, path, progress)
        if ok or mode == "git":
            if not ok:
                raise ToolingError(f"git clone of {target.git_url} failed and ${FETCH_ENV}=git")
            return path
        progress.note("    no network path to the git host; using the registry artifact")
    _repo_from_artifact(target, root, path, progress)
    return path


def _clone_upstream(target: Target, path: Path, progress: Progress) -> bool:
    proc = gitutil.git("clone", "-q", "--bare", "--depth", "1", "--branch", target.git_tag,
                       target.git_url, str(path), check=False,
                       env={"GIT_HTTP_LOW_SPEED_LIMIT": "1000", GIT_TIMEOUT_ENV: "30"})
    if proc.returncode != 0:
        progress.note(f"    git clone failed: {proc.stderr.strip().splitlines()[-1:]}")
        shutil.rmtree(path, ignore_errors=True)
        return False
    if target.git_commit:
        commit = gitutil.git("rev-parse", f"{target.git_tag}^{{commit}}", cwd=path).stdout.strip()
        if commit != target.git_commit:
            shutil.rmtree(path, ignore_errors=True)
            raise ChecksumMismatch(
                f"{target.git_url} tag {target.git_tag} is {commit}, the targets file records {target.git_commit}"
            )
    return True


def _repo_from_artifact(target: Target, root: Path, path: Path, progress: Progress) -> None:
    artifact = registry.fetch_file(target.engine, target.artifact, target.artifact_sha256, root, progress)
    with tempfile.TemporaryDirectory(prefix="prefill-accel-fetch-") as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        with progress.step(f"Unpacking {artifact.name} into a git repository"):
            if artifact.name.endswith(".whl"):
                unpack_wheel_sources(artifact, work, target)
            else:
                unpack_sdist(artifact, work)
            gitutil.git("init", "-q", cwd=work)
            gitutil.commit_all(work, f"{target.engine} {target.version} from {artifact.name}\n\n"
                                     f"Unpacked from the registry artifact (sha256 {target.artifact_sha256}).")
            gitutil.git("tag", target.git_tag, cwd=work)
            gitutil.git("clone", "-q", "--bare", str(work), str(path))


def unpack_sdist(sdist: Path, dest: Path) -> None:
    """Extract an sdist's single top directory's contents into dest."""
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        top = {m.name.split("/", 1)[0] for m in members}
        if len(top) != 1:
            raise ToolingError(f"{sdist.name}: expected one top-level directory, found {sorted(top)}")
        prefix = top.pop() + "/"
        for member in members:
            if not member.name.startswith(prefix):
                continue
            member.name = member.name[len(prefix):]
            tar.extract(member, dest, filter="data")


def unpack_wheel_sources(wheel: Path, dest: Path, target: Target) -> None:
    """Place a wheel's package sources (no compiled modules, no dist-info) under the path prefix."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or not name.startswith(f"{target.package}/") or name.endswith((".so", ".pyd")):
                continue
            out = dest / target.path_prefix / name
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
