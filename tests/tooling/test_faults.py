"""The tooling under faults: signals and kills mid-apply, a corrupted cache, bad paths and arguments.

Faults are injected from outside the code under test where they can be: a `git` on PATH that runs the
real one and then signals or kills the CLI process (or its whole process group, as a terminal's Ctrl-C
does), a read-only mount, a corrupted object in the cache.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prefill_accel.cli import main
from prefill_accel.tooling import journal, registry
from prefill_accel.tooling.apply import apply
from prefill_accel.tooling.errors import ToolingError
from prefill_accel.tooling.fetch import fetch
from prefill_accel.tooling.journal import JOURNAL_NAME, Interrupted
from prefill_accel.progress import Progress

from .conftest import QUIET, ROOT, fetched, tree_digest

TARGET = "vllm-0.6.3.post1"
# Runs the real git, then, after the first call of $FAULT_ON, sends $FAULT_SIGNAL to the CLI process (its
# parent) or, with $FAULT_GROUP, to the CLI's process group. $FAULT_AM_STOP names a patch that does not
# apply: `git am` then gets the series' first patch and that one, so it stops mid-series.
FAKE_GIT = """#!/bin/bash
i=1
while [ "${{!i}}" = "-c" ]; do i=$((i + 2)); done
sub="${{!i}}"
if [ "$sub" = am ] && [ "$FAULT_ON" = am ] && [ -n "$FAULT_AM_STOP" ]; then
    args=(); first=""
    for a in "$@"; do
        case "$a" in
            *.patch) if [ -z "$first" ]; then args+=("$a" "$FAULT_AM_STOP"); first=1; fi ;;
            *) args+=("$a") ;;
        esac
    done
    set -- "${{args[@]}}"
fi
"{real}" "$@"
rc=$?
if [ "$sub" = "$FAULT_ON" ] && [ ! -e "$FAULT_FIRED" ]; then
    touch "$FAULT_FIRED"
    if [ -n "$FAULT_GROUP" ]; then kill -s "$FAULT_SIGNAL" -- "-$PPID"; else kill -s "$FAULT_SIGNAL" "$PPID"; fi
    sleep 0.5
fi
[ "$sub" = "$FAULT_FAIL" ] && exit 1
exit $rc
"""


@pytest.fixture
def fake_git(tmp_path) -> Path:
    folder = tmp_path / "fake-git"
    folder.mkdir()
    script = folder / "git"
    script.write_text(FAKE_GIT.format(real=shutil.which("git")))
    script.chmod(0o755)
    return folder


def default_signals() -> None:
    """In the child: SIGINT, SIGTERM and SIGHUP as a terminal session has them, whatever the test runner
    inherited (a background job ignores SIGINT, nohup SIGHUP, and an ignored signal stays ignored)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def cli(args: list[str], fake_git: Path, **fault: str) -> subprocess.CompletedProcess:
    """The CLI in a process (and process group) of its own, with the faulty git first on PATH."""
    env = {**os.environ, "PATH": f"{fake_git}{os.pathsep}{os.environ['PATH']}", "PREFILL_ACCEL_ROOT": str(ROOT),
           "PYTHONPATH": str(ROOT / "kernels"), "FAULT_FIRED": str(fake_git / "fired"), **fault}
    return subprocess.run([sys.executable, "-m", "prefill_accel.cli", *args], env=env, capture_output=True,
                          text=True, start_new_session=True, preexec_fn=default_signals, timeout=600)


def reference_head(tmp_path) -> str:
    tree = fetched(TARGET, tmp_path / "reference")
    assert main(["apply", TARGET, str(tree), "-q"]) == 0
    return git(tree, "rev-parse", "HEAD")


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True, check=True).stdout.strip()


def leftovers(tree: Path) -> list[str]:
    return sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if "prefill-accel-" in p.name
                  and p.name != "prefill-accel-pristine.json")


# 1. an interrupted apply: undone on every exit path, finished or restored by a rerun ---------------------

@pytest.mark.parametrize("fault_on, sig, group", [
    ("am", "INT", "1"),       # Ctrl-C in a terminal: the whole process group, right after `git am`
    ("am", "TERM", ""),       # a supervisor's stop
    ("add", "INT", "1"),      # while the overlay is being committed
    ("commit", "HUP", ""),    # the terminal closed, at the overlay commit itself
])
def test_a_signal_during_apply_to_a_git_tree_undoes_it(tmp_path, fake_git, fault_on, sig, group):
    tree = fetched(TARGET, tmp_path / "tree")
    before = tree_digest(tree)
    done = cli(["apply", TARGET, str(tree)], fake_git, FAULT_ON=fault_on, FAULT_SIGNAL=sig, FAULT_GROUP=group)
    assert done.returncode == 130, done.stderr
    assert f"SIG{sig} received; everything this run changed was undone" in done.stderr
    assert tree_digest(tree) == before
    assert not (tree / ".git" / "rebase-apply").exists() and not (tree / ".git" / JOURNAL_NAME).exists()
    assert git(tree, "status", "--porcelain", "--untracked-files=all") == ""
    # A rerun starts from the unchanged tree and finishes.
    assert main(["apply", TARGET, str(tree), "-q"]) == 0
    assert git(tree, "rev-parse", "HEAD") == reference_head(tmp_path)


def test_a_rerun_after_apply_was_killed_mid_series_restores_then_finishes(tmp_path, fake_git, capsys):
    tree = fetched(TARGET, tmp_path / "tree")
    start = git(tree, "rev-parse", "HEAD")
    broken = tmp_path / "broken.patch"
    broken.write_text("From: x <x@example.invalid>\nSubject: [PATCH] broken\n\n---\ndiff --git a/nope b/nope\n"
                      "--- a/nope\n+++ b/nope\n@@ -1 +1 @@\n-a\n+b\n")
    done = cli(["apply", TARGET, str(tree)], fake_git, FAULT_ON="am", FAULT_SIGNAL="KILL", FAULT_AM_STOP=str(broken))
    assert done.returncode == -signal.SIGKILL
    # What a kill leaves: the first patch committed, `git am` stopped mid-series, the journal.
    assert git(tree, "rev-list", "--count", f"{start}..HEAD") == "1"
    assert (tree / ".git" / "rebase-apply").is_dir() and (tree / ".git" / JOURNAL_NAME).is_file()

    assert main(["apply", TARGET, str(tree)]) == 0
    assert f"an interrupted apply was rolled back: {tree} is back at {start[:12]}" in capsys.readouterr().err
    assert git(tree, "rev-parse", "HEAD") == reference_head(tmp_path)
    assert not (tree / ".git" / JOURNAL_NAME).exists()


def installed_copy(tmp_path, name: str) -> Path:
    tree = fetched(TARGET, tmp_path / f"{name}-tree")
    site = tmp_path / name
    shutil.copytree(tree / "vllm", site / "vllm")
    return site


def write_then(fault, after: int):
    """journal.write_file that calls fault() once `after` files have been replaced."""
    real, count = journal.write_file, []

    def write(path, data):
        real(path, data)
        count.append(path)
        if len(count) == after:
            fault()

    return write


@pytest.fixture
def terminal_sigint():
    """SIGINT as a terminal session has it (Python's handler), even where the runner inherited it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_signal_during_apply_to_an_installed_package_restores_every_file(tmp_path, monkeypatch, targets,
                                                                         terminal_sigint):  # fmt: skip
    site = installed_copy(tmp_path, "site")
    before = tree_digest(site)
    monkeypatch.setattr(journal, "write_file", write_then(lambda: os.kill(os.getpid(), signal.SIGINT), after=3))
    with pytest.raises(Interrupted, match="SIGINT received"):
        apply(targets.resolve(TARGET), site, ROOT, QUIET)
    assert tree_digest(site) == before and leftovers(site) == []


def test_a_signal_the_process_ignores_stays_ignored(tmp_path, monkeypatch, targets):
    """Started with SIGINT ignored (nohup, a background job), apply does not start acting on it."""
    site = installed_copy(tmp_path, "site")
    monkeypatch.setattr(journal, "write_file", write_then(lambda: os.kill(os.getpid(), signal.SIGINT), after=3))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        apply(targets.resolve(TARGET), site, ROOT, QUIET)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (site / "vllm" / "prefill_accel_series.json").is_file() and leftovers(site) == []


def test_a_rerun_after_apply_to_an_installed_package_was_killed_restores_then_finishes(tmp_path, targets):
    target = targets.resolve(TARGET)
    site, reference = installed_copy(tmp_path, "site"), installed_copy(tmp_path, "reference")
    before = tree_digest(site)
    apply(target, reference, ROOT, QUIET)
    pid = os.fork()
    if pid == 0:  # the child dies after three files, as under kill -9
        journal.write_file = write_then(lambda: os._exit(137), after=3)
        try:
            apply(target, site, ROOT, QUIET)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 137
    assert tree_digest(site) != before  # three files were replaced, the stamp was not written
    notes = io.StringIO()
    apply(target, site, ROOT, Progress(stream=notes))
    assert "an interrupted apply was rolled back" in notes.getvalue()
    assert tree_digest(site) == tree_digest(reference) and leftovers(site) == []


def apply_under_read_only_mount(tree: Path, read_only: Path) -> subprocess.CompletedProcess:
    """The CLI's apply to tree in a mount namespace of its own where ``read_only`` is mounted read-only
    (this also stops root, whom file modes do not)."""
    env = {**os.environ, "PREFILL_ACCEL_ROOT": str(ROOT), "PYTHONPATH": str(ROOT / "kernels")}
    command = f'mount --bind -o ro "$1" "$1" && exec "$2" -m prefill_accel.cli apply {TARGET} "$3"'
    return subprocess.run(["unshare", "-m", "sh", "-c", command, "sh", str(read_only), sys.executable, str(tree)],
                          env=env, capture_output=True, text=True)  # fmt: skip


@pytest.mark.parametrize("kind", ["git", "installed"])
def test_apply_into_a_read_only_tree_says_so_and_changes_nothing(tmp_path, kind):
    tree = fetched(TARGET, tmp_path / "tree") if kind == "git" else installed_copy(tmp_path, "site")
    before = tree_digest(tree)
    done = apply_under_read_only_mount(tree, tree)
    assert done.returncode == 2, done.stderr
    assert f"{tree} is not writable; apply needs to change files there (nothing was changed)" in done.stderr
    assert tree_digest(tree) == before and leftovers(tree) == []


def test_a_write_refused_mid_apply_to_an_installed_package_restores_and_names_the_cause(tmp_path):
    site = installed_copy(tmp_path, "site")
    before = tree_digest(site)
    # Only vllm/core (where the scheduler patches write) is read-only: the check up front passes.
    done = apply_under_read_only_mount(site, site / "vllm" / "core")
    assert done.returncode == 1, done.stderr
    assert f"writing {site}/vllm/core/" in done.stderr and "Read-only file system" in done.stderr
    assert "everything this run changed was undone" in done.stderr
    assert tree_digest(site) == before and leftovers(site) == []


# 2. export needs a tree that carries the series ---------------------------------------------------------

def test_export_refuses_a_tree_without_the_series_and_a_missing_tree(scratch_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PREFILL_ACCEL_ROOT", str(scratch_root))
    patches = scratch_root / "patches" / "vllm" / "0.6.3.post1"
    before = tree_digest(patches)
    plain = fetched(TARGET, tmp_path / "plain", scratch_root)
    assert main(["export", TARGET, "--tree", str(plain)]) == 2
    assert "does not carry the series" in capsys.readouterr().err
    assert main(["export", TARGET, "--tree", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", "vllm-0.26.0", "--tree", str(plain)]) == 2
    assert "is not built on vllm-0.26.0's tag v0.26.0" in capsys.readouterr().err
    assert tree_digest(patches) == before


# 3. paths never become options -------------------------------------------------------------------------

def test_a_directory_named_like_an_option_is_just_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = "--template=injected"
    assert main(["fetch", TARGET, "-q", "--", name]) == 0
    assert (tmp_path / name / ".git").is_dir() and (tmp_path / name / "vllm" / "__init__.py").is_file()
    assert os.listdir(tmp_path) == [name]


# 4. the cache is checked against the pins before it is served ------------------------------------------

@pytest.fixture
def own_cache(tmp_path, monkeypatch, targets) -> Path:
    """A cache of this test's own, holding the verified artifact (linked from the shared cache)."""
    artifact = registry.fetch_file("vllm", targets.resolve(TARGET).artifact, targets.resolve(TARGET).artifact_sha256,
                                   ROOT, QUIET)
    cache = tmp_path / "cache"
    (cache / "dist").mkdir(parents=True)
    os.link(artifact, cache / "dist" / artifact.name)
    monkeypatch.setenv(registry.CACHE_ENV, str(cache))
    return cache


def refetch(targets, dest: Path) -> str:
    notes = io.StringIO()
    fetch(targets.resolve(TARGET), dest, ROOT, Progress(stream=notes))
    return notes.getvalue()


def test_a_moved_tag_in_the_cache_is_found_and_the_tree_made_again(own_cache, tmp_path, targets):
    first = fetched(TARGET, tmp_path / "first")
    pristine = own_cache / "trees" / f"{TARGET}.git"
    empty_tree = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
    moved = subprocess.run(["git", "commit-tree", empty_tree, "-m", "not upstream"], cwd=pristine, check=True,
                           capture_output=True, text=True, env={**os.environ, "GIT_AUTHOR_NAME": "x",
                           "GIT_AUTHOR_EMAIL": "x@x", "GIT_COMMITTER_NAME": "x", "GIT_COMMITTER_EMAIL": "x@x"}).stdout
    git(pristine, "tag", "-f", "v0.6.3.post1", moved.strip())
    notes = refetch(targets, tmp_path / "second")
    assert "has tag v0.6.3.post1 at" in notes and "making it again from the pinned source" in notes
    assert tree_digest(tmp_path / "second") == tree_digest(first)


def test_a_corrupted_object_in_the_cache_is_found_and_the_tree_made_again(own_cache, tmp_path, targets):
    first = fetched(TARGET, tmp_path / "first")
    pristine = own_cache / "trees" / f"{TARGET}.git"
    loose = sorted(p for p in (pristine / "objects").glob("??/*"))
    assert loose, "expected the pristine repository's objects to be loose"
    victim = loose[len(loose) // 2]
    victim.chmod(0o644)
    victim.write_bytes(b"not a git object")
    notes = refetch(targets, tmp_path / "second")
    assert "fails git fsck" in notes and "making it again" in notes
    assert tree_digest(tmp_path / "second") == tree_digest(first)


def test_a_failed_fetch_leaves_no_half_checked_out_directory(own_cache, tmp_path, fake_git, monkeypatch, targets):
    monkeypatch.setenv("PATH", f"{fake_git}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAULT_FAIL", "switch")
    with pytest.raises(ToolingError):
        fetch(targets.resolve(TARGET), tmp_path / "tree", ROOT, QUIET)
    assert sorted(os.listdir(tmp_path)) == ["cache", "fake-git"]
    monkeypatch.delenv("FAULT_FAIL")
    assert (fetch(targets.resolve(TARGET), tmp_path / "tree", ROOT, QUIET) / "vllm" / "__init__.py").is_file()


# the commands check their arguments before they start work ---------------------------------------------

def test_verify_checks_python_and_tests_before_fetching(tmp_path, capsys):
    work = tmp_path / "work"
    assert main(["verify", TARGET, "--python", str(tmp_path / "no-python"), "--work", str(work)]) == 2
    assert "cannot be run" in capsys.readouterr().err
    assert main(["verify", TARGET, "--python", sys.executable, "--work", str(work),
                 "--tests", "tests/core/test_scheduler.py", "tests/no_such_test.py"]) == 2
    assert "upstream tests not in the tree at v0.6.3.post1: tests/no_such_test.py" in capsys.readouterr().err
    assert not work.exists()


def test_rebase_checks_the_version_and_the_upstream(scratch_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PREFILL_ACCEL_ROOT", str(scratch_root))
    before = tree_digest(scratch_root)
    assert main(["rebase", "vllm", "0.6.3.post1", "../../elsewhere", "--upstream", str(tmp_path)]) == 2
    assert "is not a release version" in capsys.readouterr().err
    work = tmp_path / "work"
    assert main(["rebase", "vllm", "0.6.3.post1", "0.6.4", "--upstream", str(tmp_path / "missing"),
                 "--work", str(work)]) == 2
    assert "cannot clone --upstream" in capsys.readouterr().err
    assert not work.exists() and tree_digest(scratch_root) == before

