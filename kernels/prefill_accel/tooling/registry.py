"""Download one pinned file of a project from the package index, checksum-verified and cached.

The index is the one pip uses: $PREFILL_ACCEL_INDEX_URL, else $PIP_INDEX_URL, else pip's configured
`index-url`, else pip's default. Files are looked up through the index's JSON simple API (PEP 691),
which also reports each file's sha256; the download is always checked against the checksum recorded in
the targets file, never against the index's word alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from ..progress import Progress
from .errors import ChecksumMismatch, ToolingError

CACHE_ENV = "PREFILL_ACCEL_CACHE"
INDEX_ENV = "PREFILL_ACCEL_INDEX_URL"
_JSON_SIMPLE = "application/vnd.pypi.simple.v1+json"


def cache_dir(root: Path) -> Path:
    """$PREFILL_ACCEL_CACHE, else .cache/prefill-accel in the checkout (ignored by git)."""
    path = Path(os.environ.get(CACHE_ENV) or root / ".cache" / "prefill-accel")
    path.mkdir(parents=True, exist_ok=True)
    return path


def index_url() -> str:
    for value in (os.environ.get(INDEX_ENV), os.environ.get("PIP_INDEX_URL"), _pip_config_index()):
        if value:
            return value.rstrip("/")
    from pip._internal.models.index import PyPI  # pip's own default index

    return PyPI.simple_url.rstrip("/")


def _pip_config_index() -> str:
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _listing(project: str) -> tuple[str, dict]:
    url = f"{index_url()}/{project}/"
    request = urllib.request.Request(url, headers={"Accept": _JSON_SIMPLE})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return url, json.load(response)
    except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as e:
        raise ToolingError(f"cannot read the package index for {project} ({url}): {e}") from None


def file_info(project: str, filename: str) -> dict:
    """The index's entry for one file of a project: {"filename", "url", "hashes", ...}."""
    url, listing = _listing(project)
    for entry in listing.get("files", []):
        if entry["filename"] == filename:
            return {**entry, "url": urllib.parse.urljoin(url, entry["url"])}
    raise ToolingError(f"the package index has no file {filename} for {project}")


def fetch_file(project: str, filename: str, sha256: str, root: Path,
               progress: Progress | None = None) -> Path:
    """A verified local copy of `filename`: from the cache when it checks out, else downloaded."""
    progress = progress or Progress()
    dest = cache_dir(root) / "dist" / filename
    if dest.is_file():
        if sha256_of(dest) == sha256:
            progress.note(f"    using cached {dest.name}")
            return dest
        progress.note(f"    cached {dest.name} fails its checksum; downloading again")
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    entry = file_info(project, filename)
    with progress.step(f"Downloading {filename}"):
        _download(entry["url"], dest, entry.get("size"), progress)
    actual = sha256_of(dest)
    if actual != sha256:
        dest.unlink()
        raise ChecksumMismatch(
            f"{filename}: sha256 {actual} does not match the recorded {sha256} (patches/targets.toml)"
        )
    return dest


def _download(url: str, dest: Path, size: int | None, progress: Progress) -> None:
    update = progress.bytes(dest.name, size)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with urllib.request.urlopen(url, timeout=120) as response, os.fdopen(fd, "wb") as out:
            done = 0
            while chunk := response.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                update(done)
        os.replace(tmp, dest)
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        Path(tmp).unlink(missing_ok=True)
        raise ToolingError(f"download of {dest.name} failed: {e}") from None


def release_sdist(project: str, version: str) -> dict:
    """The index entry of a release's sdist (rebase pins a new target with it)."""
    return file_info(project, f"{project}-{version}.tar.gz")
