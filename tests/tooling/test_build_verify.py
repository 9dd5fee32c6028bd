"""build.sh --venv end to end, and verify (upstream tests unpatched vs patched, plus ours) on all targets.

The venv build installs the real vLLM 0.6.3.post1 wheel (~190 MB, cached) with its pinned CPU
dependencies; verify then runs upstream's ~940 scheduler/block tests twice. Together ~4 minutes.
verify vllm-0.26.0 builds its cached test environment on first use (~80 s: torch 2.13 CPU, the
~290 MB wheel, the pinned requirements) and runs upstream's 288 v1 core tests twice (~40 s each).
SGLang 0.5.16 is built as a venv once and verified in its cached test environment (~2 minutes each).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from prefill_accel.errors import UsageError
from prefill_accel.tooling.targets import target_from_toml
from prefill_accel.tooling.errors import ToolingError
from prefill_accel.tooling.verify import (FAILED, OFFLINE_REVISION, PASSED, SKIPPED, Harness, PytestRun,
                                          check_tests_exist, offline_hf_home, run_pytest_together, verify)

from .conftest import QUIET, ROOT, VENV_TARGET, fetched


# The engine's own startup hook, called with a logger that prints: the banner as the engine logs it.
LOG_TO_STDOUT = "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s'); "


@pytest.fixture(scope="session")
def built_venv(tmp_path_factory):
    venv = tmp_path_factory.mktemp("build") / "venv"
    env = dict(os.environ, PREFILL_ACCEL_TOOL_PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build.sh"), VENV_TARGET, "--venv", str(venv), "--cpu"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Built virtualenv {venv}" in proc.stdout
    return venv / "bin" / "python"


def test_built_venv_imports_the_patched_engine_and_logs_the_series(built_venv, targets):
    code = (LOG_TO_STDOUT + "import vllm.engine.llm_engine as m; "
            "assert m.log_prefill_accel_series.__module__ == 'vllm.prefill_accel_series'; "
            "m.log_prefill_accel_series(logging.getLogger('banner'))")
    proc = subprocess.run([str(built_venv), "-c", code], capture_output=True, text=True, cwd=ROOT.parent,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    assert "prefill-accel 0.1.0 patch series" in proc.stdout
    series = (targets.resolve(VENV_TARGET).patch_dir(ROOT) / "series").read_text().split()
    assert f"({VENV_TARGET}, {len(series)} patch(es))" in proc.stdout


def test_built_sglang_venv_imports_the_patched_modules(tmp_path, targets):
    """build.sh --venv for SGLang 0.5.16 (~2 minutes, ~6 GB: a CUDA build of torch, see its requirements
    file): the installed engine carries the series, its patched modules import, and the prefill backend
    is registered."""
    venv = tmp_path / "sglang-venv"
    env = dict(os.environ, PREFILL_ACCEL_TOOL_PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build.sh"), "sglang-0.5.16", "--venv", str(venv), "--cpu"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = (LOG_TO_STDOUT + "import sglang.srt.entrypoints.engine as e, sglang.srt.managers.scheduler as s, "
            "sglang.srt.layers.attention.sparse_prefill_backend; "
            "from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS; "
            "from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES; "
            "assert 'sparse_prefill' in ATTENTION_BACKENDS and 'sparse_prefill' in ATTENTION_BACKEND_CHOICES; "
            "assert s.PrefillStreak.__module__ == 'sglang.srt.managers.decode_protection'; "
            "assert e.log_prefill_accel_series.__module__ == 'sglang.prefill_accel_series'; "
            "e.log_prefill_accel_series(logging.getLogger('banner'))")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    series = (targets.resolve("sglang-0.5.16").patch_dir(ROOT) / "series").read_text().split()
    assert f"(sglang-0.5.16, {len(series)} patch(es))" in proc.stdout


def test_upstream_scheduler_tests_pass_against_the_installed_patched_engine(built_venv, targets, tmp_path):
    tree = fetched(VENV_TARGET, tmp_path / "tree")
    tests = tmp_path / "run" / "tests"
    shutil.copytree(tree / "tests", tests)  # outside the tree, so `import vllm` is the installed package
    proc = subprocess.run(
        [str(built_venv), "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/core/test_scheduler.py", "tests/core/test_chunked_prefill_scheduler.py"],
        cwd=tests.parent, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.splitlines()[-1] and "failed" not in proc.stdout.splitlines()[-1]


def test_every_kernel_compiles_for_hopper_under_the_triton_of_vllm_0_6(built_venv):
    """The environment of vLLM 0.6.3 holds the Triton its torch 2.4 pins (3.0, no tensor descriptors):
    scripts/compile_check.py compiles every kernel launch of the page-table read path for sm_90 with it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([str(built_venv), str(ROOT / "scripts" / "compile_check.py")], capture_output=True,
                          text=True, env=env, timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "(triton 3.0.0)" in proc.stdout and "; 0 failures" in proc.stdout, proc.stdout[-4000:]


def test_verify_passes_with_counts_for_both_trees(built_venv, targets):
    report = verify(targets.resolve(VENV_TARGET), ROOT, str(built_venv), progress=QUIET)
    rendered = report.render()
    assert report.ok, rendered
    assert report.unpatched.count(PASSED) >= 900, rendered
    assert report.patched.count(PASSED) == report.unpatched.count(PASSED), rendered
    assert report.ours.count(PASSED) > 0 and report.ours.count(FAILED) == 0, rendered
    assert "upstream tests, unpatched: " in rendered and "upstream tests, patched: " in rendered


def test_verify_vllm_0_26_runs_upstream_core_tests_against_the_wheel_unpatched_and_patched(targets):
    """Upstream's scheduler, prefix-caching and KV-cache tests, in the cached test environment.

    On CPU torch the 35 multimodal (llava) scheduler tests fail on both trees (no torchvision build for
    it); every other test passes, and the gate is the difference.
    """
    target = targets.resolve("vllm-0.26.0")
    report = verify(target, ROOT, progress=QUIET)
    rendered = report.render()
    assert report.ok, rendered
    assert "envs/vllm-0.26.0" in report.python, rendered
    assert report.unpatched.count(PASSED) >= 253, rendered
    unpatched_failures = [t for t, r in report.unpatched.results.items() if r == FAILED]
    assert len(unpatched_failures) <= 35 and all("test_scheduler.py" in t for t in unpatched_failures), rendered
    assert report.patched.count(PASSED) >= report.unpatched.count(PASSED), rendered
    assert report.ours.count(PASSED) >= 3 and report.ours.count(FAILED) == 0, rendered


def test_verify_sglang_says_why_no_upstream_tests_ran_and_runs_ours(targets):
    """The SGLang wheel carries no scheduler tests and SGLang publishes no sdist: 0/0, with the reason.

    Ours run in the target's cached test environment (built on first use, ~2 minutes): the sparse_prefill
    backend against SGLang's pools, dense backend, registry and hybrid setup (15), and the flags (their help the
    runtime's) and scheduler policies on real ServerArgs, Req, SchedulePolicy, PrefillAdder and Scheduler
    code (18), the distributed store on loopback (3), and the step-latency target's chunk sizing on a real
    Scheduler, prefill-first and mixed, and a chat srpf puts ahead of a held chunk going whole (8).
    """
    report = verify(targets.resolve("sglang-0.5.16"), ROOT, progress=QUIET)
    rendered = report.render()
    assert report.ok, rendered
    assert "envs/sglang-0.5.16" in report.python, rendered
    assert "upstream tests, unpatched: 0 passed, 0 failed, 0 skipped (none run: SGLang publishes no sdist" in rendered
    assert report.ours.count(PASSED) == 44 and report.ours.count(SKIPPED) == 0, rendered


RENDEZVOUS = """
import pathlib, time
def test_meets_the_other_side():
    here = pathlib.Path(__file__).parent
    (here.parent / "{me}").write_text("")
    deadline = time.time() + 120
    while not (here.parent / "{other}").exists():
        assert time.time() < deadline, "the other run never started: the runs went one after the other"
        time.sleep(0.05)
"""


def test_the_unpatched_and_patched_upstream_runs_go_side_by_side(tmp_path):
    """Each side's test waits for the other's to have started, so both pass only if the two ran at once."""
    harness = Harness((), (), {})
    runs = []
    for me, other in (("a", "b"), ("b", "a")):
        (tmp_path / me).mkdir()
        (tmp_path / me / "test_side.py").write_text(RENDEZVOUS.format(me=f"{me}.started", other=f"{other}.started"))
        runs.append(PytestRun(sys.executable, harness, [], tmp_path / me, ["test_side.py"], tmp_path / f"{me}.xml"))
    for outcomes in run_pytest_together(*runs):
        assert outcomes.results == {"test_side.py::test_meets_the_other_side": PASSED}
    assert "1 passed" in (tmp_path / "a.log").read_text()


def test_a_side_that_writes_no_report_names_its_output_and_stops_the_other(tmp_path):
    harness = Harness((), (), {})
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "test_slow.py").write_text("import time\ndef test_slow():\n    time.sleep(600)\n")
    broken = PytestRun(sys.executable, harness, [], tmp_path, ["--no-such-option"], tmp_path / "broken.xml")
    slow = PytestRun(sys.executable, harness, [], tmp_path / "slow", ["test_slow.py"], tmp_path / "slow.xml")
    with pytest.raises(ToolingError, match="(?s)pytest did not run .*no-such-option"):
        run_pytest_together(broken, slow)
    assert not (tmp_path / "slow.xml").exists()


def test_offline_hf_home_is_a_hub_cache_of_the_named_configs(tmp_path):
    home = offline_hf_home(("facebook/opt-125m",), ROOT, tmp_path / "hf")
    repo = home / "hub" / "models--facebook--opt-125m"
    assert (repo / "refs" / "main").read_text() == OFFLINE_REVISION
    assert (repo / "snapshots" / OFFLINE_REVISION / "config.json").is_file()
    with pytest.raises(UsageError, match="no offline config for the model nobody/none"):
        offline_hf_home(("nobody/none",), ROOT, tmp_path / "hf2")


def test_a_target_without_upstream_tests_must_say_why(targets):
    text = targets.resolve("sglang-0.5.16").to_toml().replace("no_cpu_tests_reason = ", "# ")
    with pytest.raises(UsageError, match="say why in no_cpu_tests_reason"):
        target_from_toml(text)


def test_verify_on_a_gpu_needs_the_gpu_environments_interpreter(targets):
    with pytest.raises(UsageError, match="needs --python"):
        verify(targets.resolve(VENV_TARGET), ROOT, gpu=True, progress=QUIET)
    with pytest.raises(UsageError, match="names no gpu_tests"):
        verify(targets.resolve("sglang-0.5.16"), ROOT, sys.executable, gpu=True, progress=QUIET)


def test_the_gpu_harness_compiles_triton_for_the_device_without_cpu_plugins(targets, tmp_path):
    cpu = Harness.prepare(targets.resolve("vllm-0.26.0"), ROOT, tmp_path / "cpu")
    gpu = Harness.prepare(targets.resolve("vllm-0.26.0"), ROOT, tmp_path / "gpu", gpu=True)
    assert cpu.plugins == ("vllm_cpu_platform",) and gpu.plugins == () and gpu.paths == ()
    assert gpu.env["TRITON_INTERPRET"] == "0" and "TRITON_INTERPRET" not in cpu.env
    v0 = Harness.prepare(targets.resolve(VENV_TARGET), ROOT, tmp_path / "v0", gpu=True)
    assert (tmp_path / "v0" / "hf-home" / "hub" / "models--facebook--opt-125m").is_dir()
    assert v0.env["HF_HOME"] == str(tmp_path / "v0" / "hf-home")


def test_every_gpu_test_of_a_target_is_in_its_upstream_tree_at_the_tag(targets):
    named = [target for target in targets.targets.values() if target.gpu_tests]
    assert named, "no target names gpu_tests"
    for target in named:
        check_tests_exist(target, ROOT, list(target.gpu_tests), QUIET)  # raises, naming what is missing
