"""scripts/compile_check.py: every kernel launch compiles for sm_90 (H100/H200) within its shared memory,
and the check takes its compile workers with it however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compile_check.py"
RECORDING_S = 300  # the host functions run on small CPU inputs, the launches recorded
# One variant's compile by one worker, with margin: 2.3 s each on a quiet 2-core machine with an empty
# triton cache, twice that with another job loading it (152 variants in 5m49s, 2026-12-01).
COMPILE_S = 15


def session_processes(session: int) -> list[int]:
    """Pids of the processes still in a session (the check and its workers run in one of their own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def start(env: dict) -> tuple[subprocess.Popen, int, int]:
    """The check in a session of its own; returns it with the variants and workers it announced."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + RECORDING_S
    for line in proc.stdout:
        if line.startswith("compiling "):
            words = line.split()
            return proc, int(words[1]), int(words[5])
        assert time.monotonic() < deadline, "recording the launches took too long"
    proc.wait()
    raise AssertionError(f"compile_check.py ended before compiling (exit {proc.returncode})")


def test_every_kernel_launch_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc, variants, workers = start(env)
    limit = COMPILE_S * -(-variants // workers)  # the limit follows from the work announced
    try:
        rest, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{variants} variants on {workers} workers took over {limit} s") from None
    assert proc.returncode == 0, rest[-4000:]
    assert "0 failures" in rest


def test_a_killed_check_leaves_no_worker_behind(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # nothing cached: the workers are busy compiling
    proc, _, workers = start(env)
    deadline = time.monotonic() + 60
    while len(session_processes(proc.pid)) < 1 + min(workers, 2):
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.1)
    proc.kill()  # as a test runner's timeout kills it: the check alone, no chance to clean up
    proc.wait()
    proc.stdout.close()
    deadline = time.monotonic() + 10
    while session_processes(proc.pid):
        assert time.monotonic() < deadline, f"workers outlived the check: {session_processes(proc.pid)}"
        time.sleep(0.1)


def test_batches_of_other_lengths_compile_nothing_new():
    """Launches alike at compile time are specialised alike, whatever the batch's lengths (see --stable)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--stable"], env=env, capture_output=True, text=True,
                          timeout=RECORDING_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("0 specialised by batch")
