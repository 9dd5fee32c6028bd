"""Run upstream's own tests on the unpatched and the patched engine; fail only on regressions.

Upstream's suites do not all pass on a CPU machine even unpatched, so the gate is the difference: a test
that passes unpatched and fails patched is a regression. Our own tests (overlay files under upstream's
test directories) exist only in the patched tree and must all pass.

The work directory (kept with --work):
  unpatched/, patched/   the upstream tree at its tag, fetched twice; the series applied to patched/
  *-tests/               each tree's test directories and root test configuration, copied out of the tree
                         (run from the tree root, pytest would import the tree's own package)
  patched-site/          a hard-linked copy of the pinned wheel's package with the series applied to it as to
                         an installed package; the unpatched one is the wheel unpacked once into the cache
  hf-home/               an offline HF_HOME holding the config files of the target's cpu_test_models
  unpatched.xml, patched.xml, ours.xml and each one's .log: a pytest run's junit report and its output
Upstream tests run from the test copies with the wheel's package (unpatched or patched) first on PYTHONPATH,
so they exercise what ships, the two sides at once; ours run in the patched tree with its package first.
Patched runs also get the checkout's kernels/ (the runtime package the install step adds to a patched
engine). Every run uses the interpreter given (default: the target's cached test environment,
envbuild.cached_test_env) and loads the target's cpu_test_plugins from ci/upstream-tests/.

With gpu=True (`verify --gpu`, on a machine with a GPU and the interpreter of the GPU environment that
`build.sh --venv DIR --gpu` makes) the upstream runs are the target's gpu_tests: the wheel keeps its compiled
kernels (no venv_remove), Triton compiles for the device instead of interpreting, no CPU-platform plugins
load, and the offline HF_HOME holds the gpu_test_models. Ours are not run there: they check the overlay on
CPU stand-ins, which the CPU runs do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ElementTree
import zipfile
from pathlib import Path

from ..errors import UsageError
from ..progress import Progress
from . import envbuild, gitutil, registry
from .apply import apply
from .errors import ToolingError
from .fetch import fetch, pristine_repo
from .overlay import overlay_files
from .targets import Target

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
SUPPORT_DIR = Path("ci") / "upstream-tests"
RUNTIME_DIR = Path("kernels")
# Any commit-shaped name will do: the offline hub cache only needs refs/main to name the snapshot.
OFFLINE_REVISION = "0" * 40
ROOT_TEST_CONFIG = ("pyproject.toml", "setup.cfg", "pytest.ini", "tox.ini", "conftest.py")
# Defaults of every test run (the caller's environment wins): no model hub, and, on a CPU machine, Triton
# kernels through the interpreter, set before any test module imports them (as tests/conftest.py does there).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
RUN_DEFAULTS = {**OFFLINE, "TRITON_INTERPRET": "1"}
UNPACKED_MARKER = ".prefill-accel-unpacked.json"


@dataclasses.dataclass
class Outcomes:
    """Test node id -> passed / failed / skipped, from one pytest run; reason says why none ran."""

    results: dict[str, str]
    reason: str = ""

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.results.values() if r == outcome)

    def summary(self) -> str:
        counts = f"{self.count(PASSED)} passed, {self.count(FAILED)} failed, {self.count(SKIPPED)} skipped"
        return f"{counts} (none run: {self.reason})" if self.reason else counts


@dataclasses.dataclass
class VerifyReport:
    target: Target
    python: str
    unpatched: Outcomes
    patched: Outcomes
    ours: Outcomes
    gpu: bool = False

    @property
    def regressions(self) -> list[str]:
        return sorted(t for t, r in self.unpatched.results.items()
                      if r == PASSED and self.patched.results.get(t) != PASSED)

    @property
    def ok(self) -> bool:
        return not self.regressions and self.ours.count(FAILED) == 0

    def render(self) -> str:
        where = "upstream's GPU tests on this machine's GPU, " if self.gpu else ""
        lines = [
            f"verify {self.target.name} ({where}tests run with {self.python})",
            f"  upstream tests, unpatched: {self.unpatched.summary()}",
            f"  upstream tests, patched:   {self.patched.summary()}",
            f"  our tests, patched:        {self.ours.summary()}",
            f"  regressions (pass unpatched, fail patched): {len(self.regressions)}",
        ]
        lines += [f"    {t}" for t in self.regressions]
        lines += [f"    ours failed: {t}" for t, r in sorted(self.ours.results.items()) if r == FAILED]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Harness:
    """What every test run of a target gets: its pytest plugins (and their directory on the path) and,
    where it names models, an offline HF_HOME."""

    plugins: tuple[str, ...]
    paths: tuple[Path, ...]
    env: dict[str, str]

    @classmethod
    def prepare(cls, target: Target, root: Path, work: Path, gpu: bool = False) -> "Harness":
        """The CPU runs' harness, or with gpu the GPU runs': no CPU-platform plugins, gpu_test_models, and
        Triton compiling for the device (RUN_DEFAULTS' interpreter switched off)."""
        models = target.gpu_test_models if gpu else target.cpu_test_models
        plugins = () if gpu else target.cpu_test_plugins
        env = {"TRITON_INTERPRET": "0"} if gpu else {}
        if models:
            env["HF_HOME"] = str(offline_hf_home(models, root, work / "hf-home"))
        paths = (root / SUPPORT_DIR,) if plugins else ()
        return cls(plugins, paths, env)


def offline_hf_home(models: tuple[str, ...], root: Path, home: Path) -> Path:
    """A new HF_HOME whose hub cache holds just the files under ci/upstream-tests/hf-configs/ of each model."""
    for name in models:
        source = root / SUPPORT_DIR / "hf-configs" / name
        if not (source / "config.json").is_file():
            raise UsageError(f"no offline config for the model {name}: add {source / 'config.json'} "
                             f"(see {SUPPORT_DIR / 'README.md'})")
        repo = home / "hub" / f"models--{name.replace('/', '--')}"
        shutil.copytree(source, repo / "snapshots" / OFFLINE_REVISION)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(OFFLINE_REVISION)
    return home


def our_tests(target: Target, root: Path) -> list[str]:
    """Overlay files that are tests placed in upstream's test tree (outside the package)."""
    return [rel for rel in overlay_files(target, root)
            if not rel.startswith(target.package_path + "/") and Path(rel).name.startswith("test_")
            and rel.endswith(".py")]


def verify(target: Target, root: Path, python: str | None = None, work: Path | None = None,
           tests: list[str] | None = None, progress: Progress | None = None, gpu: bool = False) -> VerifyReport:
    progress = progress or Progress()
    upstream_tests = list(tests if tests is not None else target.gpu_tests if gpu else target.cpu_tests)
    if gpu and python is None:
        raise UsageError("verify --gpu needs --python: the interpreter of a GPU environment "
                         f"(scripts/build.sh {target.name} --venv DIR --gpu)")
    if gpu and not upstream_tests:
        raise UsageError(f"{target.name} names no gpu_tests (patches/targets.toml); give --tests")
    if python is not None:
        check_python(python)
    if work is not None and Path(work).exists() and any(Path(work).iterdir()):
        raise UsageError(f"--work {work} exists and is not empty; give a new directory")
    check_tests_exist(target, root, upstream_tests, progress)
    if python is None:
        python = str(envbuild.cached_test_env(target, root, progress))
    with tempfile.TemporaryDirectory(prefix="prefill-accel-verify-") as tmp:
        work = Path(work or tmp).resolve()
        unpatched, patched = work / "unpatched", work / "patched"
        fetch(target, unpatched, root, progress)
        fetch(target, patched, root, progress)
        apply(target, patched, root, progress)
        harness = Harness.prepare(target, root, work, gpu)
        runtime = root / RUNTIME_DIR  # the patched engine's prefill_accel, as the install step provides it
        if upstream_tests:
            site = unpacked_wheel(target, root, progress, gpu)
            patched_site = work / "patched-site"
            with progress.step(f"Linking a copy of {site.name} to patch"):
                linked_copy(site, patched_site)
            apply(target, patched_site, root, progress)
            with progress.step(f"Upstream tests, unpatched and patched side by side ({len(upstream_tests)} file(s))"):
                before, after = run_pytest_together(
                    PytestRun(python, harness, [site], copy_tests(unpatched, upstream_tests, work / "unpatched-tests"),
                              upstream_tests, work / "unpatched.xml"),
                    PytestRun(python, harness, [patched_site, runtime],
                              copy_tests(patched, upstream_tests, work / "patched-tests"), upstream_tests,
                              work / "patched.xml"))  # fmt: skip
        else:
            reason = target.no_cpu_tests_reason if tests is None else "no upstream tests requested"
            before = after = Outcomes({}, reason)
        if gpu:  # ours check the overlay on CPU stand-ins, through Triton's interpreter
            ours = Outcomes({}, "ours run on a CPU machine (verify without --gpu)")
        else:
            with progress.step("Our tests on the patched tree"):
                # Ours are self-contained: upstream's conftest would demand its full test environment.
                ours = run_pytest(python, harness, [patched / target.path_prefix, runtime], patched,
                                  our_tests(target, root), work / "ours.xml", "--noconftest")
    return VerifyReport(target, python, before, after, ours, gpu)


def check_python(python: str) -> None:
    """A usage error, before any work, unless python runs and has pytest."""
    try:
        proc = subprocess.run([python, "-c", "import pytest"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UsageError(f"--python {python} cannot be run ({error})") from None
    if proc.returncode != 0:
        raise UsageError(f"--python {python} has no pytest ({proc.stderr.strip().splitlines()[-1:]}); "
                         "give an interpreter with the engine's test dependencies")


def check_tests_exist(target: Target, root: Path, tests: list[str], progress: Progress) -> None:
    """A usage error, before the trees are made, naming each test path not in the upstream tree at the tag."""
    if not tests:
        return
    pristine = pristine_repo(target, root, progress)
    missing = [t for t in tests
               if t.startswith(("/", "-")) or gitutil.git("cat-file", "-e", f"{target.git_tag}:{t.split('::')[0]}",
                                                          cwd=pristine, check=False).returncode]
    if missing:
        raise UsageError(f"{target.name}: upstream tests not in the tree at {target.git_tag}: {', '.join(missing)} "
                         "(paths are relative to the tree's root, e.g. tests/core/test_scheduler.py)")


def unpacked_wheel(target: Target, root: Path, progress: Progress, gpu: bool = False) -> Path:
    """The target's pinned wheel unpacked (site-packages layout), cached; do not modify. For CPU runs
    venv_remove is applied; for GPU runs (gpu) the wheel stays whole, in a directory of its own."""
    wheel = registry.fetch_file(target.engine, target.wheel, target.wheel_sha256, root, progress)
    dest = registry.cache_dir(root) / "wheels" / (wheel.name.removesuffix(".whl") + ("-gpu" if gpu else ""))
    removed = () if gpu else target.venv_remove
    marker = {"wheel_sha256": target.wheel_sha256, "venv_remove": list(removed)}
    if (dest / UNPACKED_MARKER).is_file() and json.loads((dest / UNPACKED_MARKER).read_text()) == marker:
        return dest
    with progress.step(f"Unpacking {wheel.name}"):
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(stage)
        if not gpu:
            envbuild.remove_cpu_breaking_files(target, stage)
        (stage / UNPACKED_MARKER).write_text(json.dumps(marker) + "\n")
        os.replace(stage, dest)
    return dest


def linked_copy(src: Path, dest: Path) -> None:
    """Copy a directory as hard links where the file system allows: apply replaces files, never writes
    into them, so the source stays as it was."""
    def link(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(src, dest, copy_function=link)


def copy_tests(tree: Path, tests: list[str], dest: Path) -> Path:
    """The tree's top-level test directories of tests, plus its root test configuration, copied to dest."""
    for top in sorted({t.split("/", 1)[0] for t in tests}):
        shutil.copytree(tree / top, dest / top)
    for name in ROOT_TEST_CONFIG:
        if (tree / name).is_file():
            shutil.copy2(tree / name, dest / name)
    return dest


@dataclasses.dataclass
class PytestRun:
    """pytest in cwd on tests (cwd-relative) with package_dirs first on the path, its junit report in junit and
    its output beside it (junit with .log)."""

    python: str
    harness: Harness
    package_dirs: list[Path]
    cwd: Path
    tests: list[str]
    junit: Path
    options: tuple[str, ...] = ()

    def start(self) -> subprocess.Popen:
        env = {**RUN_DEFAULTS, **os.environ, **self.harness.env}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (*map(str, self.package_dirs), *map(str, self.harness.paths), env.get("PYTHONPATH", "")) if p)
        plugins = [arg for name in self.harness.plugins for arg in ("-p", name)]
        cmd = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, "--junitxml", str(self.junit),
               "-o", "junit_family=xunit1", *self.options, *self.tests]  # fmt: skip
        with self.junit.with_suffix(".log").open("w") as log:
            return subprocess.Popen(cmd, cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)

    def outcomes(self, proc: subprocess.Popen) -> Outcomes:
        """The finished run's outcomes; a ToolingError with its output's tail where pytest wrote no report."""
        returncode = proc.wait()
        if not self.junit.is_file():
            tail = "\n".join(self.junit.with_suffix(".log").read_text().strip().splitlines()[-20:])
            raise ToolingError(f"pytest did not run in {self.cwd} (exit {returncode}):\n{tail}")
        return parse_junit(self.junit)


def run_pytest(python: str, harness: Harness, package_dirs: list[Path], cwd: Path, tests: list[str], junit: Path,
               *options: str) -> Outcomes:
    """Run pytest in cwd on tests (cwd-relative) with package_dirs first on the path."""
    if not tests:
        return Outcomes({})
    run = PytestRun(python, harness, package_dirs, cwd, tests, junit, options)
    return run.outcomes(run.start())


def run_pytest_together(*runs: PytestRun) -> list[Outcomes]:
    """The runs at once, each its own process (the unpatched and the patched tree share nothing they write):
    vLLM 0.6.3's CPU tests took 39 s side by side against 37 s + 37 s one after the other on 2 cores, and on
    a GPU machine each side of its GPU tests had taken over 5 minutes. The others are stopped where one
    fails to report or the wait is interrupted."""
    procs = []
    try:
        for run in runs:
            procs.append(run.start())
        return [run.outcomes(proc) for run, proc in zip(runs, procs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


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
