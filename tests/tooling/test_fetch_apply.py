"""fetch and apply on all three targets: real artifacts, real git, atomic failure, double-apply."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess

import pytest

from prefill_accel.cli import main
from prefill_accel.tooling import registry
from prefill_accel.tooling.apply import STAMP_NAME, apply
from prefill_accel.tooling.errors import AlreadyApplied, OverlayConflict, PatchDoesNotApply
from prefill_accel.tooling.series import Series
from prefill_accel.tooling.targets import Targets

from .conftest import QUIET, ROOT, TARGET_NAMES, fetched, tree_digest


def patch_subject(path) -> str:
    """The commit subject a git-format patch carries (its Subject header, unfolded)."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Subject: "))
    folded = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            break
        folded.append(line)
    return " ".join(part.strip() for part in folded).removeprefix("Subject: [PATCH] ")


def git(tree, *args) -> str:
    return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_fetch_gives_the_tagged_upstream_tree_from_a_verified_artifact(targets, tmp_path, name):
    target = targets.resolve(name)
    tree = fetched(name, tmp_path / "tree")
    assert git(tree, "describe", "--tags", "--exact-match").strip() == target.git_tag
    assert (tree / target.package_path / "__init__.py").is_file()
    artifact = registry.cache_dir(ROOT) / "dist" / target.artifact
    assert registry.sha256_of(artifact) == target.artifact_sha256
    for test in target.cpu_tests:
        assert (tree / test).is_file(), f"upstream test {test} missing from the fetched tree"


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_apply_to_git_tree_commits_the_series_and_rejects_a_second_apply(targets, tmp_path, name):
    target = targets.resolve(name)
    tree = fetched(name, tmp_path / "tree")
    assert main(["apply", name, str(tree), "-q"]) == 0
    log = git(tree, "log", "--format=%s", f"{target.git_tag}..HEAD").splitlines()
    subjects = [patch_subject(patch.path) for patch in Series(ROOT / "patches" / target.engine / target.version)]
    assert subjects[0] == "Log the prefill-accel patch series at engine startup"
    assert log == [f"prefill-accel: overlay and build stamp for {name}", *reversed(subjects)]
    stamp = json.loads((tree / target.package_path / STAMP_NAME).read_text())
    assert stamp["target"] == name and len(stamp["series_hash"]) == 12
    assert (tree / target.package_path / "prefill_accel_series.py").is_file()
    assert_startup_hook(tree, target)

    before = tree_digest(tree)
    assert main(["apply", name, str(tree), "-q"]) == 4
    assert tree_digest(tree) == before


def assert_startup_hook(tree, target) -> None:
    """The engine file the series' first patch changes imports the adapter's log_series and calls it."""
    first = Series(target.patch_dir(ROOT)).patches[0]
    (engine_file,) = {f.path for f in first.files if f.path.endswith(".py") and "prefill_accel_series" not in f.path}
    module = ast.parse((tree / engine_file).read_text())
    glue = target.package + ".prefill_accel_series"
    assert any(isinstance(node, ast.ImportFrom) and node.module == glue
               and [(a.name, a.asname) for a in node.names] == [("log_series", "log_prefill_accel_series")]
               for node in ast.walk(module)), f"{engine_file} does not import the startup hook"  # fmt: skip
    assert any(isinstance(node, ast.Call) and getattr(node.func, "id", None) == "log_prefill_accel_series"
               for node in ast.walk(module)), f"{engine_file} does not call the startup hook"  # fmt: skip


def test_patches_applied_by_hand_are_detected_too(targets, tmp_path):
    tree = fetched("vllm-0.6.3.post1", tmp_path / "tree")
    patch_dir = ROOT / "patches/vllm/0.6.3.post1"
    patches = [str(patch_dir / name) for name in (patch_dir / "series").read_text().split()]
    git(tree, "am", "-q", *patches)
    with pytest.raises(AlreadyApplied, match="already applied"):
        apply(targets.resolve("vllm-0.6.3.post1"), tree, ROOT, QUIET, with_overlay=False)


@pytest.mark.parametrize("name", ["vllm-0.6.3.post1", "sglang-0.5.16"])
def test_apply_to_installed_package_strips_the_path_prefix(targets, tmp_path, name):
    target = targets.resolve(name)
    tree = fetched(name, tmp_path / "tree")
    site = tmp_path / "site-packages"
    shutil.copytree(tree / target.package_path, site / target.package)
    result = apply(target, site, ROOT, QUIET)
    assert result.layout.kind == "installed"
    assert (site / target.package / STAMP_NAME).is_file()
    assert (site / target.package / "prefill_accel_series.py").is_file()
    assert not (site / "tests").exists() and not (site / "test").exists()  # our tests stay out of site-packages
    hooked = [rel for rel in result.changed if rel.endswith(".py") and "prefill_accel_series" not in rel]
    assert any("log_prefill_accel_series" in (site / rel[len(target.path_prefix):]).read_text() for rel in hooked)
    with pytest.raises(AlreadyApplied):
        apply(target, site, ROOT, QUIET)


def _add_patch(root, target, name: str, text: str) -> None:
    directory = target.patch_dir(root)
    (directory / name).write_text(text)
    with open(directory / "series", "a") as series:
        series.write(f"{name}\n")


BROKEN = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: test <test@example.invalid>
Subject: [PATCH] deliberately broken

Upstream-Status: Inappropriate [test]
---
diff --git a/{path} b/{path}
--- a/{path}
+++ b/{path}
@@ -1,3 +1,3 @@
-this line is not in the file
+neither is this one
 nor this
 or this
"""


@pytest.mark.parametrize("kind", ["git", "installed"])
def test_a_broken_patch_leaves_the_tree_byte_for_byte_unchanged(scratch_root, tmp_path, kind):
    targets = Targets.load(scratch_root)
    target = targets.resolve("vllm-0.6.3.post1")
    _add_patch(scratch_root, target, "0002-broken.patch", BROKEN.format(path="vllm/sequence.py"))
    tree = fetched(target.name, tmp_path / "tree", scratch_root)
    if kind == "installed":
        shutil.copytree(tree / "vllm", tmp_path / "site" / "vllm")
        tree = tmp_path / "site"
    before = tree_digest(tree)
    with pytest.raises(PatchDoesNotApply) as failure:
        apply(target, tree, scratch_root, QUIET)
    message = str(failure.value)
    assert "0002-broken.patch" in message and "vllm/sequence.py" in message and "hunk #1" in message
    assert tree_digest(tree) == before


def test_overlay_may_not_silently_replace_an_upstream_file(scratch_root, tmp_path):
    targets = Targets.load(scratch_root)
    target = targets.resolve("vllm-0.6.3.post1")
    clash = target.overlay_dir(scratch_root) / "vllm" / "sequence.py"
    clash.write_text("# replacement\n")
    tree = fetched(target.name, tmp_path / "tree", scratch_root)
    before = tree_digest(tree)
    with pytest.raises(OverlayConflict, match="vllm/sequence.py"):
        apply(target, tree, scratch_root, QUIET)
    assert tree_digest(tree) == before
