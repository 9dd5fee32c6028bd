"""The stand-in base of a target: what the official engine image is to a prefill-accel image, made here from
a Debian rootfs and the packages the registries serve, for machines that cannot pull the official image.

docker/stand-in/Dockerfile says what each target's stand-in keeps of its official image (entrypoint,
working directory, Python layout), one stage per target; this module prepares the build context and builds
that stage, tagged stand_in_tag(target). The context:
  rootfs.tar          debootstrap --variant=minbase of DEBIAN_SUITE (built once and cached; needs root)
  wheels/install      the target's engine wheel, docker/requirements/TARGET-cpu.txt and
                      docker/stand-in/requirements/TARGET.txt (what the entrypoint imports beyond that set)
  wheels/build        the runtime package's build requirements (pyproject.toml): the stand-in's pip installs
                      from these alone, so the image build on top of it needs no package index
  vllm-cpu-platform/  the stand-in's vLLM platform plugin (docker/stand-in/)
The wheels are downloaded by this machine's pip (its index and configuration) for the stand-in's Python.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

from ..errors import UsageError
from ..progress import Progress
from . import images, registry
from .errors import ToolingError
from .targets import Target

STAND_IN_DIR = Path("docker") / "stand-in"
DEBIAN_SUITE = "bookworm"
APT_SOURCES = Path("/etc/apt")
# The suite's python3 and glibc: the wheels are downloaded for these, whatever the building machine runs.
DEBIAN_PYTHON = (3, 11)
DEBIAN_GLIBC = (2, 36)
# Files debootstrap leaves that the official Debian images do not carry (package lists, downloaded .debs).
ROOTFS_CLEAN = ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb")
_STAGE = re.compile(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", re.IGNORECASE | re.MULTILINE)


def stand_in_tag(target: Target) -> str:
    return f"prefill-accel/stand-in-base:{target.name}"


def image_tag(target: Target) -> str:
    """The tag of the target's image built FROM its stand-in (never the target's own image tag)."""
    return f"{target.image}-stand-in"


def dockerfile(root: Path) -> Path:
    return root / STAND_IN_DIR / "Dockerfile"


def extra_requirements(target: Target, root: Path) -> Path:
    return root / STAND_IN_DIR / "requirements" / f"{target.name}.txt"


def stages(root: Path) -> list[str]:
    """The stage names of docker/stand-in/Dockerfile, in order."""
    return _STAGE.findall(dockerfile(root).read_text())


def build_stand_in_base(builder: str, target: Target, root: Path, progress: Progress,
                        mirror: str | None = None) -> str:  # fmt: skip
    """Build the target's stand-in base with `builder`; returns its tag."""
    if target.name not in stages(root):
        raise UsageError(f"{dockerfile(root)} has no stage {target.name}: add one saying what {target.base_image} "
                         "keeps (ENTRYPOINT, WORKDIR, what it installs beyond the engine)")
    tag = stand_in_tag(target)
    rootfs = debian_rootfs(root, progress, mirror)
    with tempfile.TemporaryDirectory(prefix="prefill-accel-stand-in-") as tmp:
        context = Path(tmp)
        shutil.copy2(rootfs, context / "rootfs.tar")
        download_wheels(target, root, context / "wheels", progress)
        shutil.copytree(root / STAND_IN_DIR / "vllm-cpu-platform", context / "vllm-cpu-platform")
        cmd = build_command(builder, target, root, context)
        images.run_build(cmd, f"{builder} build {tag} (a stand-in for {target.base_image})", progress)
    return tag


def build_command(builder: str, target: Target, root: Path, context: Path) -> list[str]:
    return [*images.builder_command(builder), "-f", str(dockerfile(root)), "--target", target.name,
            "--build-arg", f"CPU_BREAKING_FILES={' '.join(target.venv_remove)}", "-t", stand_in_tag(target),
            "--label", f"io.prefill-accel.stand-in-for={target.base_image}", str(context)]


def host_debian_mirror(sources: Path = APT_SOURCES) -> str | None:
    """The archive this machine's apt fetches DEBIAN_SUITE from (the first source listing the suite itself,
    one-line or deb822 format), or None."""
    files = [sources / "sources.list", *sorted((sources / "sources.list.d").glob("*.list")),
             *sorted((sources / "sources.list.d").glob("*.sources"))]  # fmt: skip
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.MULTILINE))
                if DEBIAN_SUITE in fields.get("Suites", "").split() and fields.get("URIs"):
                    return fields["URIs"].split()[0]
            continue
        for line in text.splitlines():
            words = re.sub(r"\[[^\]]*\]", "", line.split("#", 1)[0]).split()
            if len(words) >= 3 and words[0] == "deb" and words[2] == DEBIAN_SUITE:
                return words[1]
    return None


def debian_rootfs(root: Path, progress: Progress, mirror: str | None = None) -> Path:
    """A tarball of `debootstrap --variant=minbase DEBIAN_SUITE` from `mirror` (default: the archive this
    machine's apt uses for the suite), cached as $PREFILL_ACCEL_CACHE/stand-in/debian-SUITE-minbase.tar
    (delete it to bootstrap again)."""
    dest = registry.cache_dir(root) / "stand-in" / f"debian-{DEBIAN_SUITE}-minbase.tar"
    if dest.is_file():
        progress.note(f"    using the cached rootfs {dest}")
        return dest
    if not shutil.which("debootstrap"):
        raise UsageError("the stand-in base needs debootstrap for its Debian rootfs (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise UsageError("debootstrap makes the stand-in's Debian rootfs and needs root: run the first "
                         "--stand-in-base build as root (later builds reuse the cached rootfs)")
    mirror = mirror or host_debian_mirror()
    if mirror is None:
        raise UsageError(f"no apt source of this machine lists Debian {DEBIAN_SUITE}: name the archive "
                         "debootstrap should fetch from with --debian-mirror URL")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".rootfs-") as tmp:
        tree = Path(tmp) / "rootfs"
        with progress.step(f"debootstrap --variant=minbase {DEBIAN_SUITE} from {mirror}"):
            _run(["debootstrap", "--variant=minbase", DEBIAN_SUITE, str(tree), mirror])
        for pattern in ROOTFS_CLEAN:
            for path in tree.glob(pattern):
                if path.is_file():
                    path.unlink()
        partial = Path(tmp) / "rootfs.tar"
        _run(["tar", "--numeric-owner", "-C", str(tree), "-cf", str(partial), "."])
        os.replace(partial, dest)
    return dest


def download_wheels(target: Target, root: Path, dest: Path, progress: Progress) -> None:
    """dest/install: the engine wheel and the requirement sets; dest/build: the runtime's build requirements."""
    install, build = dest / "install", dest / "build"
    install.mkdir(parents=True)
    build.mkdir(parents=True)
    requirements = [root / target.venv_requirements]
    if extra_requirements(target, root).is_file():
        requirements.append(extra_requirements(target, root))
    for path in requirements:
        if not path.is_file():
            raise UsageError(f"{target.name}: no requirements file {path}")
    wheel = registry.fetch_file(target.engine, target.wheel, target.wheel_sha256, root, progress)
    shutil.copy2(wheel, install / wheel.name)
    with progress.step(f"Downloading the stand-in's wheels ({', '.join(p.name for p in requirements)})"):
        _run(pip_download_command(install, [arg for path in requirements for arg in ("-r", str(path))]))
    with open(root / "pyproject.toml", "rb") as f:
        build_requires = tomllib.load(f)["build-system"]["requires"]
    with progress.step(f"Downloading the runtime package's build requirements ({', '.join(build_requires)})"):
        _run(pip_download_command(build, build_requires))


def pip_download_command(dest: Path, requirements: list[str]) -> list[str]:
    """pip download of binary wheels for the stand-in's Python and glibc (not this machine's), --no-deps:
    the requirement files pin every package."""
    major, minor = DEBIAN_PYTHON
    machine = platform.machine()
    platforms = [f"manylinux_{DEBIAN_GLIBC[0]}_{m}_{machine}" for m in range(DEBIAN_GLIBC[1], 4, -1)]
    platforms += [f"{legacy}_{machine}" for legacy in ("manylinux2014", "manylinux2010", "manylinux1")]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "--dest", str(dest),
           "--implementation", "cp", "--python-version", f"{major}.{minor}",
           "--abi", f"cp{major}{minor}", "--abi", "abi3", "--abi", "none"]
    for tag in platforms:
        cmd += ["--platform", tag]
    return [*cmd, *requirements]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()
        raise ToolingError(f"{' '.join(cmd[:5])} ... failed (exit {proc.returncode}):\n{output[-3000:]}")
