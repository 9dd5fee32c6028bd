"""The vLLM general plugin: inert without vLLM or on other versions, loud on an unpatched vLLM 0.26.0 or 0.6.3."""

import logging
import sys
import tomllib
import types
from enum import Enum
from importlib import import_module
from pathlib import Path

import pytest

from prefill_accel.integrations import vllm_plugin

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def fake_vllm(monkeypatch, version, members):
    """Stand-in vllm package with the module holding the backend names the plugin reads: V1's registry
    (0.26.0) or V0's selector (0.6.3)."""
    v0 = version.startswith("0.6.")
    path = ("vllm", "vllm.attention", "vllm.attention.selector") if v0 else (
        "vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends", "vllm.v1.attention.backends.registry")
    modules = {name: types.ModuleType(name) for name in path}
    modules["vllm"].__version__ = version
    enum_name = "_Backend" if v0 else "AttentionBackendEnum"
    setattr(modules[path[-1]], enum_name, Enum(enum_name, {name: f"path.{name}" for name in members}))
    for parent, child in zip(path, path[1:]):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_entry_point_names_the_register_function():
    entry = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]["vllm.general_plugins"]["prefill_accel"]
    module, _, attr = entry.partition(":")
    assert getattr(import_module(module), attr) is vllm_plugin.register


def test_without_vllm_it_does_nothing(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with caplog.at_level(logging.DEBUG, logger=vllm_plugin.__name__):
        vllm_plugin.register()
    assert caplog.records == []


@pytest.mark.parametrize("version, members, expected", [
    ("0.26.0", ["FLASH_ATTN", "CUSTOM"], logging.WARNING),
    ("0.26.0", ["FLASH_ATTN", "SPARSE_PREFILL", "CUSTOM"], None),
    ("0.6.3.post1", ["FLASH_ATTN", "XFORMERS"], logging.WARNING),
    ("0.6.3.post1", ["FLASH_ATTN", "SPARSE_PREFILL"], None),
    ("0.27.0", ["FLASH_ATTN", "CUSTOM"], logging.DEBUG),
])
def test_reports_an_unpatched_vllm_only_where_a_series_exists(monkeypatch, caplog, version, members, expected):
    fake_vllm(monkeypatch, version, members)
    with caplog.at_level(logging.DEBUG, logger=vllm_plugin.__name__):
        vllm_plugin.register()
    assert [r.levelno for r in caplog.records] == ([expected] if expected else [])
    if expected == logging.WARNING:
        assert f"prefill-accel install vllm-{version}" in caplog.records[0].getMessage()
