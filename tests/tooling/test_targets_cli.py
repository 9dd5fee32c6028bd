"""The targets file, alias resolution and the CLI surface (help, exit codes)."""

from __future__ import annotations

import subprocess

import pytest

from prefill_accel.cli import COMMAND_TABLES, main
from prefill_accel.errors import UsageError
from prefill_accel.tooling.series import Series

from .conftest import ROOT, TARGET_NAMES


def test_targets_file_lists_the_three_pinned_targets(targets):
    assert sorted(targets.targets) == sorted(TARGET_NAMES)
    assert targets.resolve("vllm-0.6.x").name == "vllm-0.6.3.post1"
    assert targets.resolve("sglang-0.5.16").package_path == "python/sglang"


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_every_target_has_a_real_series_and_overlay(targets, name):
    target = targets.resolve(name)
    series = Series(target.patch_dir(ROOT))
    assert len(series) >= 1
    for patch in series:
        assert "Upstream-Status:" in patch.path.read_text(), f"{patch.name}: DEP-3 header missing"
    assert (target.overlay_dir(ROOT) / target.package_path).is_dir()
    assert (ROOT / target.venv_requirements).is_file()


def test_unknown_target_is_a_usage_error(targets):
    with pytest.raises(UsageError, match="known: vllm-0.26.0"):
        targets.resolve("vllm-9.9")
    assert main(["fetch", "vllm-9.9", "/nonexistent"]) == 2


def test_every_subcommand_has_help(capsys):
    for table in COMMAND_TABLES:
        for name in table:
            with pytest.raises(SystemExit) as done:
                main([name, "--help"])
            assert done.value.code == 0 and "usage: prefill-accel" in capsys.readouterr().out, name


def test_targets_command_prints_images(capsys):
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    assert "prefill-accel/vllm:0.26.0-pa1 FROM vllm/vllm-openai:v0.26.0" in out
    assert "vllm-0.6.3.post1 (alias vllm-0.6.x)" in out


def test_wrapper_scripts_explain_themselves():
    for script in ("build.sh", "install-into-env.sh", "prefill-accel"):
        proc = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True)
        assert proc.returncode == 0 and "sage" in proc.stdout, script
