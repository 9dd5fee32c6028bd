"""Run upstream's own CPU-capable tests on the unpatched and the patched tree; fail only on regressions.

Upstream's suites do not all pass on a CPU machine even unpatched, so the gate is the difference: a test
that passes on the unpatched tree and fails on the patched one is a regression. Our own tests (overlay
files under upstream's test directories) exist only in the patched tree and must all pass.

Tests run with the given interpreter (an environment holding the engine's test dependencies, e.g. one
made by `build.sh --venv`), with the tree's package directory first on PYTHONPATH so `import vllm`
resolves to the tree under test, not to an installed copy.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from .apply import apply
from .errors import ToolingError, UsageError
from .fetch import fetch
from .overlay import overlay_files
from .progress import Progress
from .targets import Target

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclasses.dataclass
class Outcomes:
    """Test node id -> passed / failed / skipped, from one pytest run."""

    results: dict[str, str]

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.results.values() if r == outcome)

    def summary(self) -> str:
        return f"{self.count(PASSED)} passed, {self.count(FAILED)} failed, {self.count(SKIPPED)} skipped"


@dataclasses.dataclass
class VerifyReport:
    target: Target
    unpatched: Outcomes
    patched: Outcomes
    ours: Outcomes

    @property
    def regressions(self) -> list[str]:
        return sorted(t for t, r in self.unpatched.results.items()
                      if r == PASSED and self.patched.results.get(t) != PASSED)

    @property
    def ok(self) -> bool:
        return not self.regressions and self.ours.count(FAILED) == 0

    def render(self) -> str:
        lines = [
            f"verify {self.target.name}",
            f"  upstream tests, unpatched: {self.unpatched.summary()}",
            f"  upstream tests, patched:   {self.patched.summary()}",
            f"  our tests, patched:        {self.ours.summary()}",
            f"  regressions (pass unpatched, fail patched): {len(self.regressions)}",
        ]
        lines += [f"    {t}" for t in self.regressions]
        lines += [f"    ours failed: {t}" for t, r in sorted(self.ours.results.items()) if r == FAILED]
        return "\n".join(lines)


def our_tests(target: Target, root: Path) -> list[str]:
    """Overlay files that are tests placed in upstream's test tree (outside the package)."""
    return [rel for rel in overlay_files(target, root)
            if not rel.startswith(target.package_path + "/") and Path(rel).name.startswith("test_")
            and rel.endswith(".py")]


def verify(target: Target, root: Path, python: str | None = None, work: Path | None = None,
           tests: list[str] | None = None, progress: Progress | None = None) -> VerifyReport:
    progress = progress or Progress()
    python = python or sys.executable
    upstream_tests = list(tests if tests is not None else target.cpu_tests)
    with tempfile.TemporaryDirectory(prefix="prefill-accel-verify-") as tmp:
        work = Path(work or tmp)
        unpatched, patched = work / "unpatched", work / "patched"
        fetch(target, unpatched, root, progress)
        fetch(target, patched, root, progress)
        apply(target, patched, root, progress)
        missing = [t for t in upstream_tests if not (unpatched / t.split("::")[0]).exists()]
        if missing:
            raise UsageError(f"{target.name}: upstream tests not in the tree: {', '.join(missing)}")
        with progress.step(f"Upstream tests on the unpatched tree ({len(upstream_tests)} file(s))"):
            before = run_pytest(python, target, unpatched, upstream_tests, work / "unpatched.xml")
        with progress.step("Upstream tests on the patched tree"):
            after = run_pytest(python, target, patched, upstream_tests, work / "patched.xml")
        with progress.step("Our tests on the patched tree"):
            # Ours are self-contained: upstream's conftest would demand its full test environment.
            ours = run_pytest(python, target, patched, our_tests(target, root), work / "ours.xml",
                              "--noconftest")
    return VerifyReport(target, before, after, ours)


def run_pytest(python: str, target: Target, tree: Path, tests: list[str], junit: Path,
               *options: str) -> Outcomes:
    """Run pytest on tests (tree-relative) with the tree's package first on the path."""
    if not tests:
        return Outcomes({})
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tree / target.path_prefix), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(junit),
           "-o", "junit_family=xunit1", *options, *tests]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if not junit.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise ToolingError(f"pytest did not run in {tree} (exit {proc.returncode}):\n{tail}")
    return parse_junit(junit)


def parse_junit(path: Path) -> Outcomes:
    results: dict[str, str] = {}
    for case in ElementTree.parse(path).iter("testcase"):
        node = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            results[node] = FAILED
        elif "skipped" in tags:
            results[node] = SKIPPED
        else:
            results[node] = PASSED
    return Outcomes(results)
