"""The package's surface: the runtime's public names, and the tools that must run without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import prefill_accel

ROOT = Path(__file__).resolve().parents[1]
# Imports of torch and triton fail in the child, as on a machine (or image stage) without them.
WITHOUT_TORCH = "import sys; sys.modules.update(torch=None, triton=None); "


def test_the_public_names_resolve_to_the_runtime():
    from prefill_accel import api, config, layout

    assert prefill_accel.sparse_prefill_attention is api.sparse_prefill_attention
    assert prefill_accel.SparsePrefillConfig is config.SparsePrefillConfig
    assert prefill_accel.BatchLayout is layout.BatchLayout
    assert set(prefill_accel.__all__) <= set(dir(prefill_accel))


def test_the_cli_tooling_and_serving_tools_need_neither_torch_nor_triton():
    code = WITHOUT_TORCH + (
        "import prefill_accel.cli, prefill_accel.tooling.apply, prefill_accel.tooling.verify, "
        "prefill_accel.tooling.rebase, prefill_accel.serving.bench, prefill_accel.serving.batch; "
        "from prefill_accel.cli import main; sys.exit(main(['targets']))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT / "kernels"), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "vllm-0.26.0" in done.stdout
    blocked = subprocess.run([sys.executable, "-c", WITHOUT_TORCH + "from prefill_accel import sparse_prefill_attention"],
                             capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "kernels")})  # fmt: skip
    assert blocked.returncode != 0 and "torch" in blocked.stderr  # the runtime itself does need it
