"""Image builds of a target: the builder (a Docker engine or buildah), its command line and build context.

The same Dockerfiles (docker/Dockerfile.<engine>) build with either builder, with the same build arguments
and labels: `docker build` needs a Docker engine; `buildah build` with chroot isolation needs no daemon,
so a host without Docker (a CI runner, a rootless host) builds too. The build context is the checkout as
git sees it (tracked files and untracked ones it does not ignore), so caches, virtualenvs and build
outputs never enter an image.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from ..errors import UsageError
from ..progress import Progress
from . import gitutil
from .envbuild import series_hash
from .errors import ToolingError
from .targets import Target

BUILDERS = ("docker", "buildah")
REVISION_LABEL = "org.opencontainers.image.revision"


def docker_available() -> bool:
    """True when a Docker engine answers (a client alone is not enough)."""
    return _answers(["docker", "info"])


def buildah_available() -> bool:
    return _answers(["buildah", "version"])


def _answers(cmd: list[str]) -> bool:
    if not shutil.which(cmd[0]):
        return False
    try:
        return subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


_AVAILABLE = {"docker": docker_available, "buildah": buildah_available}


def why_unusable(builder: str) -> str:
    """What is missing for `builder`, in a few words with the fix."""
    if not shutil.which(builder):
        return f"{builder} is not installed" + (" (apt-get install buildah)" if builder == "buildah" else "")
    if builder == "docker":
        return "no Docker engine answers `docker info` (start the daemon, or use --builder buildah)"
    return "`buildah version` fails"


def no_builder_message() -> str:
    return "no image builder works here: " + "; ".join(why_unusable(b) for b in BUILDERS)


def choose_builder(requested: str | None) -> str | None:
    """The builder to build images with: `requested` when it works (a UsageError naming both builders when
    it does not), else docker where an engine answers, else buildah where installed, else None."""
    if requested is not None:
        if requested not in _AVAILABLE:
            raise UsageError(f"unknown builder {requested!r}; known: {', '.join(BUILDERS)}")
        if not _AVAILABLE[requested]():
            raise UsageError(f"--builder {requested}: {no_builder_message()}")
        return requested
    return next((builder for builder in BUILDERS if _AVAILABLE[builder]()), None)


def builder_command(builder: str) -> list[str]:
    """The command that builds a Dockerfile; arguments follow as for `docker build`. buildah runs the RUN
    steps with chroot isolation (no daemon, no runtime such as crun or runc); its storage driver is the
    one containers-storage picks or $STORAGE_DRIVER names (vfs where overlay mounts are refused)."""
    if builder == "docker":
        return ["docker", "build"]
    if builder == "buildah":
        return ["buildah", "build", "--isolation", "chroot"]
    raise UsageError(f"unknown builder {builder!r}; known: {', '.join(BUILDERS)}")


def image_labels(target: Target, root: Path, base_image: str) -> dict[str, str]:
    return {
        "org.opencontainers.image.title": f"prefill-accel {target.engine}",
        "org.opencontainers.image.version": f"{target.version}-pa{target.series_version}",
        REVISION_LABEL: gitutil.source_commit(root),
        "org.opencontainers.image.base.name": base_image,
        "io.prefill-accel.target": target.name,
        "io.prefill-accel.series-hash": series_hash(target, root),
    }


def build_command(builder: str, target: Target, root: Path, context: Path, base_image: str | None = None,
                  tag: str | None = None) -> list[str]:  # fmt: skip
    """The build of docker/Dockerfile.<engine> from `context` (a copy of the checkout, see checkout_context)
    FROM base_image (default: the target's official image), tagged `tag` (default: the target's image)."""
    labels = image_labels(target, root, base_image or target.base_image)
    if base_image is None:
        base_image = docker_hub_name(target.base_image) if builder == "buildah" else target.base_image
    cmd = [*builder_command(builder), "-f", str(context / "docker" / f"Dockerfile.{target.engine}"),
           "--build-arg", f"BASE_IMAGE={base_image}", "--build-arg", f"TARGET={target.name}",
           "--build-arg", f"PREFILL_ACCEL_COMMIT={labels[REVISION_LABEL]}", "-t", tag or target.image]
    for key, value in labels.items():
        cmd += ["--label", f"{key}={value}"]
    return [*cmd, str(context)]


def docker_hub_name(image: str) -> str:
    """The fully qualified name Docker gives an image name without a registry (vllm/vllm-openai:v0.26.0 ->
    docker.io/vllm/vllm-openai:v0.26.0): buildah resolves no such short name unless the host's
    registries.conf lists search registries."""
    first = image.split("/", 1)[0]
    if "/" in image and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"docker.io/{image}" if "/" in image else f"docker.io/library/{image}"


def checkout_context(root: Path, dest: Path) -> Path:
    """Copy into dest the files of the checkout git sees (tracked, and untracked but not ignored, as they
    are in the work tree); returns dest. Outside a git checkout, root itself is the context (and
    .dockerignore what keeps caches out)."""
    if not gitutil.is_git_tree(root):
        return root
    listing = gitutil.git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=root).stdout
    for rel in filter(None, listing.split("\0")):
        source = root / rel
        if not source.is_file():  # deleted in the work tree but not yet in the index
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / rel)
    return dest


def build_image(builder: str, target: Target, root: Path, progress: Progress, base_image: str | None = None,
                tag: str | None = None) -> str:  # fmt: skip
    """Build the target's image with `builder` (see build_command); returns its tag."""
    tag = tag or target.image
    with tempfile.TemporaryDirectory(prefix="prefill-accel-context-") as tmp:
        context = checkout_context(root, Path(tmp))
        cmd = build_command(builder, target, root, context, base_image, tag)
        run_build(cmd, f"{builder} build {tag} FROM {base_image or target.base_image}", progress)
    return tag


def run_build(cmd: list[str], step: str, progress: Progress) -> None:
    """Run a builder command with its output on this terminal; a ToolingError when it fails."""
    with progress.step(step):
        if subprocess.run(cmd).returncode != 0:
            hint = ("; where it could not mount overlay, run it again with STORAGE_DRIVER=vfs"
                    if cmd[0] == "buildah" else "")
            raise ToolingError(f"{step} failed (its output is above){hint}")
