"""pytest plugin for upstream vLLM tests on a CPU machine: vLLM's current platform is its CPU platform.

A vLLM wheel built for CUDA resolves its platform to "unspecified" on a machine without a GPU, which
breaks DeviceConfig. Loaded with `-p vllm_cpu_platform` before any test module is collected, this fills
vLLM's lazily resolved platform with the CPU one; the tests themselves are not changed.

It also marks every test `skip_global_cleanup`, upstream's own marker for CPU unit tests: otherwise each
test's teardown runs a full garbage collection and GPU cache release (~0.7 s, ten times the test).
"""

import pytest
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform

vllm.platforms._current_platform = CpuPlatform()


def pytest_configure(config):
    config.addinivalue_line("markers", "skip_global_cleanup: no global GPU/distributed cleanup after the test")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker("skip_global_cleanup")
