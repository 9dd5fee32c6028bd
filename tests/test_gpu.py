"""GPU checks (``pytest -m gpu`` on a CUDA machine): the kernels compiled for the device against the
float32 reference at serving-like sizes, and the sparse path faster than dense at long length."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bench():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device; deselect them with -m 'not gpu'")
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernels_match_reference_on_gpu(bench):
    lines = bench.check_correctness((torch.bfloat16, torch.float16), (64, 128, 256), (1, 16, 64))
    bad = [line for line in lines if not line.startswith("ok")]
    assert not bad, "\n".join(bad)


def test_sparse_path_beats_dense_at_32k(bench):
    from prefill_accel import SparsePrefillConfig, sparse_prefill_attention

    q, k, v = bench.structured_qkv(32768, 32, 8, 128, 128, torch.bfloat16, seed=1)
    k_cache, v_cache, table = bench.paged(k, v, 16)
    cu = torch.tensor([0, 32768], dtype=torch.int32, device="cuda")
    lens = torch.tensor([32768], dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, table, cu, lens)
    dense_ms = bench.cuda_time(lambda: sparse_prefill_attention(*args, config=SparsePrefillConfig(threshold=0.0)), 5)
    sparse_ms = bench.cuda_time(lambda: sparse_prefill_attention(*args, config=SparsePrefillConfig(threshold=0.05)), 5)
    assert sparse_ms < dense_ms
