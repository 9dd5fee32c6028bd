"""The vLLM general plugin: inert without vLLM or on other versions, loud on an unpatched vLLM 0.26.0."""

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
    """Stand-in vllm package with the registry module the plugin reads."""
    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends", "vllm.v1.attention.backends.registry")}
    modules["vllm"].__version__ = version
    modules["vllm.v1.attention.backends.registry"].AttentionBackendEnum = Enum(
        "AttentionBackendEnum", {name: f"path.{name}" for name in members})
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
    ("0.27.0", ["FLASH_ATTN", "CUSTOM"], logging.DEBUG),
])
def test_reports_an_unpatched_vllm_only_where_a_series_exists(monkeypatch, caplog, version, members, expected):
    fake_vllm(monkeypatch, version, members)
    with caplog.at_level(logging.DEBUG, logger=vllm_plugin.__name__):
        vllm_plugin.register()
    assert [r.levelno for r in caplog.records] == ([expected] if expected else [])
    if expected == logging.WARNING:
        assert "prefill-accel install vllm-0.26.0" in caplog.records[0].getMessage()
