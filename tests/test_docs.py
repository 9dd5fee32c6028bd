"""Doc commands print what the docs show: the accuracy-verification quick check, run as written."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def blocks_after(page: Path, marker: str) -> list[str]:
    """The fenced blocks of ``page`` that follow ``marker``, in order, without their fences."""
    text = page.read_text()
    return re.findall(r"```[a-z]*\n(.*?)```", text[text.index(marker):], flags=re.DOTALL)


def summary_rows(text: str) -> list[list[str]]:
    """The rows of the harness's summary table (after its header line), split into columns."""
    lines = text.strip().splitlines()
    header = max(i for i, line in enumerate(lines) if line.split()[:2] == ["len", "est"])
    return [line.split() for line in lines[header + 1:] if line.strip() and not set(line.strip()) <= {"-"}
            and not line.startswith("wrote")]  # fmt: skip


def test_the_accuracy_verification_quick_check_prints_what_the_page_shows(tmp_path):
    pytest.importorskip("transformers", reason="the accuracy harness needs the 'accuracy' extra")
    command, expected = blocks_after(ROOT / "docs" / "accuracy-verification.md", "A quick check on CPU")[:2]
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "prefill_accel.accuracy"]
    done = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    got, want = summary_rows(done.stdout), summary_rows(expected)
    assert [row[:-1] for row in got] == [row[:-1] for row in want]  # every column but the seconds
