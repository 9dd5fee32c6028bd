"""Triton kernels against the references on real activations: post-RoPE q/k/v of SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import Batch, rel_err
from prefill_accel import SparsePrefillConfig, select_blocks, sparse_prefill_attention
from prefill_accel.ops import attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTH = 448


@pytest.fixture(scope="module")
def layer_qkv():
    from prefill_accel.accuracy import capture_qkv

    return capture_qkv("smollm2", length=LENGTH, layers=[8], device="cpu", dtype=torch.float32)[8]


def paged_batch(qkv, dtype, page_size: int, chunk: int) -> Batch:
    """Two sequences over the same real layer: a fresh prefill and its last ``chunk`` positions
    as a continuation chunk over the cached prefix."""
    q, k, v = (qkv[name].to(dtype) for name in ("q", "k", "v"))
    n_pages = -(-LENGTH // page_size)
    order = torch.randperm(2 * n_pages)
    padded = n_pages * page_size
    to_pages = lambda x: torch.nn.functional.pad(x, (0, 0, 0, 0, 0, padded - LENGTH)).view(n_pages, page_size, *x.shape[1:])  # noqa: E731
    k_cache = torch.zeros(2 * n_pages, page_size, *k.shape[1:], dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    table = order.view(2, n_pages).to(torch.int32)
    for seq in range(2):
        k_cache[table[seq].long()], v_cache[table[seq].long()] = to_pages(k), to_pages(v)
    return Batch(
        q=torch.cat([q, q[-chunk:]]).to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        page_table=table.to(DEVICE),
        cu_seqlens_q=torch.tensor([0, LENGTH, LENGTH + chunk], dtype=torch.int32, device=DEVICE),
        seqlens_k=torch.tensor([LENGTH, LENGTH], dtype=torch.int32, device=DEVICE),
    )


@pytest.mark.parametrize("dtype, page_size", [(torch.float16, 16), (torch.bfloat16, 1)])
def test_real_activations_dense_and_sparse(layer_qkv, dtype, page_size):
    batch = paged_batch(layer_qkv, dtype, page_size, chunk=130)
    dense_config = SparsePrefillConfig(block_size=64, threshold=0.0, min_q_len=0)
    out, lse = sparse_prefill_attention(*batch.args, config=dense_config, out=torch.full_like(batch.q, float("nan")))
    want, want_lse = attention_reference.dense_paged_attention(*batch.args)
    tol = 5e-3 if dtype == torch.float16 else 2e-2
    assert rel_err(out, want) < tol
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=1e-4)

    config = SparsePrefillConfig(
        block_size=64, threshold=0.2, min_q_len=0, query_stride=4, local_blocks=0, last_query_blocks=0
    )
    index = select_blocks(*batch.search_args, config=config)
    assert index.density() < 1.0
    out, lse = sparse_prefill_attention(*batch.args, config=config, out=torch.full_like(batch.q, float("nan")))
    masked, masked_lse = attention_reference.block_masked_attention(*batch.args, index)
    assert rel_err(out, masked) < tol
    torch.testing.assert_close(lse, masked_lse, atol=2e-3, rtol=1e-4)
    # Past its partial first block, the continuation chunk attends exactly like the same rows of
    # the fresh prefill (same queries, same cached keys, same search).
    full_blocks = (LENGTH - 130) // 64 * 64 + 64
    torch.testing.assert_close(out[LENGTH + full_blocks - (LENGTH - 130) :], out[full_blocks:LENGTH], atol=0, rtol=0)
