"""Replay a target's series onto a newer upstream release with 3-way merges (GitPython).

In one work repository: the new upstream at its tag, the old upstream tag beside it (so every patch's
pre-image is there for a real 3-way merge), the old series applied as commits on the old tag, then
`git rebase --onto NEW_TAG OLD_TAG`. On success the new quilt directory, a copy of the overlay and a
targets entry are written. On a conflict nothing in the repository changes: the work tree is left
mid-rebase with instructions, and `--continue` picks up from there.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

from ..errors import UsageError
from ..progress import Progress
from .errors import RebaseConflict, ToolingError
from .export import export
from .fetch import fetch, pristine_repo
from .series import Series
from .targets import Target, Targets, target_from_toml

STATE_FILE = "prefill-accel-rebase.json"
VERSION_RE = re.compile(r"[0-9][0-9A-Za-z.+-]*")


def _git_module():
    try:
        import git
    except ImportError:
        raise UsageError("rebase needs GitPython: pip install 'prefill-accel[tooling]'") from None
    return git


def check_version(version: str) -> None:
    """A version becomes part of paths, tags and file names: a usage error unless it is a plain one."""
    if not VERSION_RE.fullmatch(version):
        raise UsageError(f"{version!r} is not a release version like 0.27.0 or 0.6.4.post1 "
                         "(digits first, then letters, digits, '.', '+' or '-')")


def _clone_upstream(git, upstream: str, work: Path, tag: str) -> None:
    """Clone the --upstream repository at tag into work, or a usage error naming what is missing."""
    try:
        git.Repo.clone_from(upstream, work, branch=tag)
    except git.GitCommandError as error:
        shutil.rmtree(work, ignore_errors=True)
        said = " ".join(str(error.stderr).split()) or str(error)
        raise UsageError(f"cannot clone --upstream {upstream} at tag {tag}: {said}") from None


def default_work_tree(engine: str, to_version: str, root: Path) -> Path:
    return root / "build" / "rebase" / f"{engine}-{to_version}"


def new_target(old: Target, to_version: str, pin_from_registry: bool) -> Target:
    """The old target's entry moved to to_version; artifact checksums from the index when asked."""
    def bump(text: str) -> str:
        return text.replace(old.version, to_version)

    target = dataclasses.replace(
        old, version=to_version, series_version=1, git_tag=bump(old.git_tag), git_commit="",
        artifact=bump(old.artifact), artifact_sha256="", wheel=bump(old.wheel), wheel_sha256="",
        base_image=bump(old.base_image),
        venv_requirements=bump(old.venv_requirements),
        gpu_wheels=tuple(bump(entry.split()[0]) for entry in old.gpu_wheels),
    )
    if pin_from_registry:
        from . import registry

        def sha256(filename: str) -> str:
            return registry.file_info(old.engine, filename)["hashes"]["sha256"]

        target = dataclasses.replace(
            target, artifact_sha256=sha256(target.artifact), wheel_sha256=sha256(target.wheel),
            gpu_wheels=tuple(f"{name} {sha256(name)}" for name in target.gpu_wheels),
        )  # fmt: skip
    return target


def rebase(targets: Targets, engine: str, from_version: str, to_version: str, work: Path,
           upstream: str | None = None, progress: Progress | None = None) -> Target:
    """Start a rebase; returns the new target on success, raises RebaseConflict on a conflict."""
    git = _git_module()
    progress = progress or Progress()
    root = targets.root
    old = targets.for_engine(engine, from_version)
    check_version(to_version)
    target = new_target(old, to_version, pin_from_registry=upstream is None)
    _check_destinations_free(targets, target)
    if work.exists():
        raise UsageError(f"{work} exists: finish it with --continue, or remove it to start over")

    with progress.step(f"Preparing {work}: {target.name} with {old.name}'s series as commits"):
        if upstream:
            _clone_upstream(git, upstream, work, target.git_tag)
        else:
            fetch(target, work, root, progress)
        repo = git.Repo(work)
        old_pristine = pristine_repo(old, root, progress)
        repo.git.fetch(str(old_pristine), f"refs/tags/{old.git_tag}:refs/tags/{old.git_tag}")
        repo.git.checkout("-q", "-B", f"prefill-accel/{target.name}", old.git_tag)
        patches = [str(p.path) for p in Series(old.patch_dir(root))]
        if patches:
            repo.git.am("-q", *patches)
    (work / ".git" / STATE_FILE).write_text(json.dumps(
        {"engine": engine, "from": from_version, "to": to_version, "target": target.to_toml()}))

    with progress.step(f"Rebasing {len(patches)} patch(es) onto {target.git_tag}"):
        try:
            repo.git.rebase("--onto", target.git_tag, old.git_tag)
        except git.GitCommandError:
            raise RebaseConflict(_conflict_report(repo, work, old, root, to_version)) from None
    return _finish(targets, old, target, work, progress)


def continue_rebase(targets: Targets, work: Path, progress: Progress | None = None) -> Target:
    """After the conflicts in work are resolved and staged: finish the rebase and write the results."""
    git = _git_module()
    progress = progress or Progress()
    state_path = work / ".git" / STATE_FILE
    if not state_path.is_file():
        raise UsageError(f"{work} holds no prefill-accel rebase in progress")
    state = json.loads(state_path.read_text())
    old = targets.for_engine(state["engine"], state["from"])
    target = target_from_toml(state["target"])
    repo = git.Repo(work)
    if (work / ".git" / "rebase-merge").exists() or (work / ".git" / "rebase-apply").exists():
        try:
            repo.git.rebase("--continue", env={"GIT_EDITOR": "true"})
        except git.GitCommandError:
            raise RebaseConflict(_conflict_report(repo, work, old, targets.root, state["to"])) from None
    return _finish(targets, old, target, work, progress)


def _check_destinations_free(targets: Targets, target: Target) -> None:
    root = targets.root
    if target.name in targets.targets:
        raise UsageError(f"{target.name} is already a target in {targets.path}")
    for path in (target.patch_dir(root), target.overlay_dir(root)):
        if path.exists():
            raise UsageError(f"{path} already exists; remove it to rebase into {target.name}")


def _finish(targets: Targets, old: Target, target: Target, work: Path, progress: Progress) -> Target:
    root = targets.root
    _check_destinations_free(targets, target)
    names = export(target, work, root, progress=progress)
    if old.overlay_dir(root).is_dir():
        shutil.copytree(old.overlay_dir(root), target.overlay_dir(root),
                        ignore=shutil.ignore_patterns("__pycache__"))
    targets.add(target)
    (work / ".git" / STATE_FILE).unlink()
    progress.note(f"Rebased {len(names)} patch(es) onto {target.name}: wrote {target.patch_dir(root)}, "
                  f"{target.overlay_dir(root)} and a [targets.\"{target.name}\"] entry")
    if not target.artifact_sha256:
        progress.note(f"    artifact_sha256 and wheel_sha256 of {target.name} are empty: pin them before use")
    return target


def _conflict_report(repo, work: Path, old: Target, root: Path, to_version: str) -> str:
    files = repo.git.diff("--name-only", "--diff-filter=U").split()
    if not files:
        raise ToolingError(f"git rebase failed in {work} without a merge conflict; see `git status` there")
    msgnum = work / ".git" / "rebase-merge" / "msgnum"
    names = [p.name for p in Series(old.patch_dir(root))]
    number = int(msgnum.read_text()) if msgnum.is_file() else 0
    patch = names[number - 1] if 0 < number <= len(names) else "(unknown patch)"
    command = f"prefill-accel rebase {old.engine} {old.version} {to_version}"
    return (
        f"rebase of {old.name} onto {to_version} stopped: {patch} conflicts in {', '.join(files)}.\n"
        f"The repository is unchanged. To resolve:\n"
        f"  cd {work}\n  # edit the files, then: git add {' '.join(files)}\n"
        f"  {command} --continue\n"
        f"To give up: rm -rf {work}"
    )
