"""scripts/e2e/unmet_requirements.py: what a staged wheel set lacks for the target Python."""

import importlib.util
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "e2e" / "unmet_requirements.py"


@pytest.fixture(scope="module")
def closure():
    spec = importlib.util.spec_from_file_location("unmet_requirements", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wheel(folder: Path, name: str, version: str, *requires: str) -> None:
    dist = f"{name}-{version}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{dist}.dist-info/METADATA", metadata)


def test_a_dependency_only_newer_pythons_need_is_unmet_for_them_alone(closure, tmp_path):
    """vLLM 0.6.3.post1 staged from a 3.11 machine: six is declared for Python > 3.11 only."""
    wheel(tmp_path, "vllm", "0.6.3", 'six>=1.16.0; python_version > "3.11"', "numpy<2", 'tomli; python_version < "3.11"')
    wheel(tmp_path, "numpy", "1.26.4")
    assert closure.unmet(tmp_path, "3.12") == ["six>=1.16.0"]
    assert closure.unmet(tmp_path, "3.11") == []
    wheel(tmp_path, "six", "1.17.0")
    assert closure.unmet(tmp_path, "3.12") == []


def test_a_staged_version_outside_the_specifier_is_unmet(closure, tmp_path):
    wheel(tmp_path, "vllm", "0.6.3", "numpy<2")
    wheel(tmp_path, "numpy", "2.1.0")
    assert closure.unmet(tmp_path, "3.12") == ["numpy<2"]


def test_the_extras_a_wheel_asks_for_bring_their_requirements(closure, tmp_path):
    wheel(tmp_path, "app", "1.0", "lib[fast]>=1")
    wheel(tmp_path, "lib", "1.2", 'speedup; extra == "fast"', 'docs-tool; extra == "docs"')
    assert closure.unmet(tmp_path, "3.12") == ["speedup"]
