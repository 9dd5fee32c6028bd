"""The upstream tree of a target at its pinned tag, as a git repository.

Two sources, tried in order (or forced with $PREFILL_ACCEL_FETCH=git|artifact):
  git       `git clone --branch TAG` of the upstream repository, checked against `git_commit` if recorded
  artifact  the registry's sdist (which carries upstream's tests) or, for an engine without one, the
            wheel's Python sources placed under the package's path prefix; checksum-verified, unpacked
            into a fresh repository with one commit tagged like upstream

Either way the pristine repository is kept in the cache (trees/NAME.git) with a record of the pins it was
made from, checked (record, tag, `git fsck`) each time it is served and made again when the check fails;
each fetch is a cheap local clone of it, so the same inputs give the same commit hashes everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path

from ..errors import UsageError
from ..progress import Progress
from . import gitutil, registry
from .errors import ChecksumMismatch, ToolingError
from .targets import Target

FETCH_ENV = "PREFILL_ACCEL_FETCH"
PRISTINE_RECORD = "prefill-accel-pristine.json"
GIT_TIMEOUT_ENV = "GIT_HTTP_LOW_SPEED_TIME"


def fetch(target: Target, dest: Path, root: Path, progress: Progress | None = None) -> Path:
    """Clone the target's upstream tree at its tag into dest (a new directory); returns dest.

    The clone is made beside dest and renamed into place, so dest is either absent or complete.
    """
    progress = progress or Progress()
    dest = Path(dest).absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} exists and is not empty; fetch needs a new directory")
    pristine = pristine_repo(target, root, progress)
    with progress.step(f"Cloning {target.name} into {dest}"):
        dest.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".prefill-accel-fetch", dir=dest.parent))
        try:
            gitutil.git("clone", "-q", "--branch", target.git_tag, "--", gitutil.path_arg(pristine),
                        gitutil.path_arg(work / "tree"))
            gitutil.git("switch", "-q", "-c", f"prefill-accel/{target.name}", cwd=work / "tree")
            if dest.exists():
                dest.rmdir()
            os.rename(work / "tree", dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return dest


def pristine_repo(target: Target, root: Path, progress: Progress) -> Path:
    """The cached bare repository holding the target's upstream tag, checked before each use.

    Made on first use from the pinned source and made again whenever its check fails (see
    `pristine_problem`): what is served always matches the pins in the targets file.
    """
    path = registry.cache_dir(root) / "trees" / f"{target.name}.git"
    if path.exists():
        problem = pristine_problem(target, path)
        if problem is None:
            return path
        progress.note(f"    the cached tree {path} {problem}; making it again from the pinned source")
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        repo = work / "repo.git"
        record = _make_pristine(target, root, repo, progress)
        (repo / PRISTINE_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(repo, path)
        except OSError:  # another fetch made it meanwhile
            if pristine_problem(target, path) is not None:
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def pristine_problem(target: Target, path: Path) -> str | None:
    """What is wrong with a cached pristine repository, or None when it can be served.

    Its record must name the pins it was made from (the artifact's sha256, or the git URL and, where
    pinned, the commit); the tag must still point at the recorded commit; and `git fsck` must find
    every object intact.
    """
    try:
        record = json.loads((path / PRISTINE_RECORD).read_text())
    except (OSError, ValueError):
        return "has no readable record of where it came from"
    if record.get("target") != target.name or record.get("tag") != target.git_tag:
        return f"was made for {record.get('target')} at {record.get('tag')}"
    if record.get("source") == "artifact":
        if record.get("artifact_sha256") != target.artifact_sha256:
            return "was made from another artifact than the pinned one"
    elif record.get("source") != "git" or record.get("git_url") != target.git_url:
        return "was made from another source than the pinned one"
    elif target.git_commit and record.get("commit") != target.git_commit:
        return f"holds commit {record.get('commit')}, the targets file pins {target.git_commit}"
    tagged = gitutil.git("rev-parse", "-q", "--verify", f"refs/tags/{target.git_tag}^{{commit}}", cwd=path,
                         check=False).stdout.strip()
    if tagged != record.get("commit"):
        return f"has tag {target.git_tag} at {tagged or 'nothing'}, not at the recorded {record.get('commit')}"
    fsck = gitutil.git("fsck", "--full", "--no-dangling", "--no-progress", cwd=path, check=False)
    if fsck.returncode:
        return f"fails git fsck ({' '.join(fsck.stderr.split())[:300]})"
    return None


def _make_pristine(target: Target, root: Path, repo: Path, progress: Progress) -> dict:
    """Make the bare repository `repo` from the pinned source; returns its record."""
    mode = os.environ.get(FETCH_ENV, "auto")
    if mode not in {"auto", "git", "artifact"}:
        raise UsageError(f"${FETCH_ENV} must be auto, git or artifact, not {mode!r}")
    record = {"target": target.name, "tag": target.git_tag}
    if mode in {"auto", "git"}:
        with progress.step(f"Cloning {target.git_url} at {target.git_tag}"):
            ok = _clone_upstream(target, repo, progress)
        if ok:
            record.update(source="git", git_url=target.git_url)
        elif mode == "git":
            raise ToolingError(f"git clone of {target.git_url} failed and ${FETCH_ENV}=git")
        else:
            progress.note("    no network path to the git host; using the registry artifact")
    if "source" not in record:
        _repo_from_artifact(target, root, repo, progress)
        record.update(source="artifact", artifact_sha256=target.artifact_sha256)
    record["commit"] = gitutil.git("rev-parse", f"{target.git_tag}^{{commit}}", cwd=repo).stdout.strip()
    return record


def _clone_upstream(target: Target, path: Path, progress: Progress) -> bool:
    proc = gitutil.git("clone", "-q", "--bare", "--depth", "1", "--branch", target.git_tag, "--",
                       target.git_url, gitutil.path_arg(path), check=False,
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
            gitutil.git("clone", "-q", "--bare", "--", gitutil.path_arg(work), gitutil.path_arg(path))


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
