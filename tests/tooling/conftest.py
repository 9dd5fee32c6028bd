"""Fixtures for the patch-tooling tests: real registry artifacts (cached), real git in temporary trees.

Downloads land in $PREFILL_ACCEL_CACHE (default .cache/prefill-accel in the checkout) and are reused
between runs; keep that directory in CI's cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from prefill_accel.tooling import registry
from prefill_accel.tooling.fetch import fetch
from prefill_accel.progress import Progress
from prefill_accel.tooling.targets import Targets, find_root

ROOT = find_root(Path(__file__).parent)
TARGET_NAMES = ["vllm-0.26.0", "vllm-0.6.3.post1", "sglang-0.5.16"]
# The cheapest target for the end-to-end venv build: ~940 upstream scheduler/block tests in ~1 min.
VENV_TARGET = "vllm-0.6.3.post1"
QUIET = Progress(quiet=True)


@pytest.fixture(scope="session", autouse=True)
def shared_cache():
    """Point every tool at the checkout's cache (even from a copied root) and skip hopeless git clones."""
    os.environ.setdefault(registry.CACHE_ENV, str(ROOT / ".cache" / "prefill-accel"))
    os.environ.setdefault("PREFILL_ACCEL_FETCH", "artifact")
    yield


@pytest.fixture(scope="session")
def targets() -> Targets:
    return Targets.load(ROOT)


@pytest.fixture
def scratch_root(tmp_path) -> Path:
    """A copy of the checkout's patches/ and overlay/ to change freely (rebase, broken series)."""
    root = tmp_path / "checkout"
    for name in ("patches", "overlay"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def fetched(target_name: str, dest: Path, root: Path = ROOT) -> Path:
    targets = Targets.load(root)
    return fetch(targets.resolve(target_name), dest, root, QUIET)


def tree_digest(path: Path) -> str:
    """sha256 over every work-tree file (path + bytes), HEAD and the refs: 'byte-for-byte the same'."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and ".git" not in p.relative_to(path).parts):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0" + file.read_bytes())
    if (path / ".git").exists():
        refs = subprocess.run(["git", "show-ref", "--head"], cwd=path, capture_output=True, text=True).stdout
        digest.update(refs.encode())
    return digest.hexdigest()
