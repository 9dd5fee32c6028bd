"""edit/export round trip and rebase onto synthetic newer upstreams (clean and conflicting)."""

from __future__ import annotations

import subprocess

import pytest

from prefill_accel.tooling.errors import RebaseConflict
from prefill_accel.tooling.export import edit, export
from prefill_accel.tooling.rebase import continue_rebase, new_target, rebase
from prefill_accel.tooling.targets import Targets

from .conftest import QUIET, ROOT, TARGET_NAMES, fetched, tree_digest

ENGINE_FILE = "vllm/engine/llm_engine.py"


def git(tree, *args) -> str:
    return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_export_round_trip_is_byte_stable(targets, tmp_path, name):
    target = targets.resolve(name)
    tree = edit(target, tmp_path / "edit", ROOT, QUIET)
    out = tmp_path / "exported"
    export(target, tree, ROOT, dest=out, progress=QUIET)
    original = target.patch_dir(ROOT)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in original.iterdir())
    for path in out.iterdir():
        assert path.read_bytes() == (original / path.name).read_bytes(), path.name
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    export(target, tree, ROOT, dest=out, progress=QUIET)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first


def _synthetic_upstream(tmp_path, root, old_line: str, new_line: str, tag: str = "v0.6.4"):
    """vLLM 0.6.3.post1 with one line of llm_engine.py changed, committed and tagged as a new release."""
    upstream = fetched("vllm-0.6.3.post1", tmp_path / "upstream", root)
    path = upstream / ENGINE_FILE
    text = path.read_text()
    assert old_line in text
    path.write_text(text.replace(old_line, new_line, 1))
    git(upstream, "commit", "-q", "-a", "-m", "upstream moves on")
    git(upstream, "tag", tag)
    return upstream


def _repo_state(root):
    return tree_digest(root / "patches"), tree_digest(root / "overlay")


def test_rebase_onto_a_clean_newer_upstream_writes_series_overlay_and_target(scratch_root, tmp_path):
    upstream = _synthetic_upstream(tmp_path, scratch_root, '"""An LLM engine that receives requests and generates texts.',
                                   '"""An LLM engine that receives requests and generates text (0.6.4).')
    targets = Targets.load(scratch_root)
    new = rebase(targets, "vllm", "0.6.3.post1", "0.6.4", tmp_path / "work", str(upstream), QUIET)
    assert new.name == "vllm-0.6.4" and new.git_tag == "v0.6.4"
    patches = scratch_root / "patches/vllm/0.6.4"
    assert (patches / "series").read_text().startswith("0001-Log-the-prefill-accel")
    assert (scratch_root / "overlay/vllm/0.6.4/vllm/prefill_accel_series.py").is_file()
    reloaded = Targets.load(scratch_root)
    assert reloaded.resolve("vllm-0.6.4").cpu_tests == reloaded.resolve("vllm-0.6.3.post1").cpu_tests
    patch_text = next(patches.glob("0001-*.patch")).read_text()
    assert "log_prefill_accel_series(logger)" in patch_text


def test_rebase_conflict_reports_and_changes_nothing_then_continue_finishes(scratch_root, tmp_path):
    upstream = _synthetic_upstream(
        tmp_path, scratch_root, "from vllm.version import __version__ as VLLM_VERSION\n",
        "from vllm.version import __version__ as VLLM_VERSION  # moved upstream\n")
    targets = Targets.load(scratch_root)
    before = _repo_state(scratch_root)
    targets_text = targets.path.read_text()
    work = tmp_path / "work"
    with pytest.raises(RebaseConflict) as conflict:
        rebase(targets, "vllm", "0.6.3.post1", "0.6.4", work, str(upstream), QUIET)
    message = str(conflict.value)
    assert "0001-Log-the-prefill-accel-patch-series-at-engine-startup.patch" in message
    assert ENGINE_FILE in message and "--continue" in message
    assert conflict.value.exit_code == 7
    assert _repo_state(scratch_root) == before and targets.path.read_text() == targets_text
    assert "<<<<<<<" in (work / ENGINE_FILE).read_text()

    git(work, "checkout", "--theirs", ENGINE_FILE)
    git(work, "add", ENGINE_FILE)
    new = continue_rebase(Targets.load(scratch_root), work, QUIET)
    assert new.name == "vllm-0.6.4"
    assert (scratch_root / "patches/vllm/0.6.4/series").is_file()


def test_a_rebased_target_moves_its_wheels_for_other_pythons_and_leaves_them_unpinned():
    old = Targets.load(ROOT).resolve("sglang-0.5.16")
    new = new_target(old, "0.5.17", pin_from_registry=False)
    assert new.gpu_wheels == ("sglang-0.5.17-cp312-cp312-manylinux_2_34_x86_64.whl",)
    assert new.wheel_for("cp312") == ("sglang-0.5.17-cp312-cp312-manylinux_2_34_x86_64.whl", "")
    assert new.wheel_for("cp311") == ("sglang-0.5.17-cp311-cp311-manylinux_2_34_x86_64.whl", "")
