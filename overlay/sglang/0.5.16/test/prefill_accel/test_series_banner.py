"""prefill-accel: the patched engine reports the applied patch series at startup.

The hook is checked statically (it runs without the engine's heavy dependencies); the glue module is
loaded from its file; importing the engine module itself is checked where its dependencies exist and
reported as skipped, with the missing module named, where they do not.
"""

import ast
import importlib
import importlib.util
import logging
from pathlib import Path

import pytest

TREE = Path(__file__).resolve().parents[2]
ENGINE_MODULE = "sglang.srt.entrypoints.engine"
ENGINE_FILE = TREE / "python/sglang/srt/entrypoints/engine.py"
GLUE_MODULE = "sglang.prefill_accel_series"
GLUE_FILE = TREE / "python/sglang/prefill_accel_series.py"


@pytest.fixture(scope="module")
def glue():
    spec = importlib.util.spec_from_file_location("prefill_accel_series_under_test", GLUE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_module_calls_the_startup_hook():
    tree = ast.parse(ENGINE_FILE.read_text())
    imported = any(
        isinstance(node, ast.ImportFrom) and node.module == GLUE_MODULE
        and any(a.name == "log_series" and a.asname == "log_prefill_accel_series" for a in node.names)
        for node in ast.walk(tree)
    )
    called = any(
        isinstance(node, ast.Call) and getattr(node.func, "id", None) == "log_prefill_accel_series"
        for node in ast.walk(tree)
    )
    assert imported and called


def test_banner_names_the_applied_series(glue):
    banner = glue.series_banner()
    assert "patch series" in banner
    assert "unknown" not in banner, f"build stamp missing or unreadable: {banner}"


def test_log_series_logs_one_info_line(glue, caplog):
    logger = logging.getLogger("prefill_accel_test")
    with caplog.at_level(logging.INFO, logger="prefill_accel_test"):
        glue.log_series(logger)
    assert [r.getMessage() for r in caplog.records] == [glue.series_banner()]


def test_engine_module_imports_with_the_hook():
    package = ENGINE_MODULE.split(".")[0]
    try:
        module = importlib.import_module(ENGINE_MODULE)
    except ImportError as e:
        if (e.name or "").split(".")[0] == package:
            raise
        pytest.skip(f"{ENGINE_MODULE} needs {e.name}, not installed in this environment")
    assert module.log_prefill_accel_series.__module__ == GLUE_MODULE
