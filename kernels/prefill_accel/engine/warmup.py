"""Compile and tune the kernels for an engine's shapes before its first request.

A Triton kernel compiles at its first launch with new compile-time arguments, and the attention
kernel times its tile shapes once per size class: left to the first long prompt, a server pays
seconds of compilation inside that request. An engine's chunks come in few shapes (its head counts,
head size, page size and chunk length are fixed at startup), so one sparse call per kind of context
its chunks meet compiles what serving then launches: a first chunk (its context is the chunk) and,
where the kernels read K/V with bulk tensor copies past TMA_SPARSE_MIN_KEYS keys, a chunk after a
prefix that long. Scratch tensors, freed afterwards; the engine's own cache is not touched.
"""

from __future__ import annotations

import os
import time

import torch

from ..config import SparsePrefillConfig
from ..layout import BatchLayout
from .startup import kernels_unavailable

ENV = "PREFILL_ACCEL_WARMUP"
"""``PREFILL_ACCEL_WARMUP=0`` leaves the compilation to the first long prompt."""

_done: set[tuple] = set()


def _compiles_on(device: torch.device) -> bool:
    """Whether the kernels compile for ``device``: on CUDA; elsewhere the package computes with its
    PyTorch reference, or Triton's interpreter runs the kernels without compiling them."""
    return device.type == "cuda"


def warmup_contexts(chunk_tokens: int, config: SparsePrefillConfig) -> list[int]:
    """The key lengths to warm up a chunk of ``chunk_tokens`` queries at: the chunk alone, then after
    a prefix that takes the sparse launch to bulk K/V reads (launch.TMA_SPARSE_MIN_KEYS); none when
    the chunk is below the minimum length (the sparse path never runs)."""
    from ..ops.launch import TMA_SPARSE_MIN_KEYS

    if chunk_tokens <= 0 or not config.long_chunk(chunk_tokens):
        return []
    contexts = [chunk_tokens]
    if chunk_tokens < TMA_SPARSE_MIN_KEYS:
        contexts.append(chunk_tokens + TMA_SPARSE_MIN_KEYS)
    return contexts


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int,
            config: SparsePrefillConfig, chunk_tokens: int, device: torch.device) -> list[int] | None:  # fmt: skip
    """Run the sparse path once for each of warmup_contexts() with these shapes, as an engine calls it
    (a prebuilt layout, a preallocated output). Returns the contexts run, or None where nothing ran:
    PREFILL_ACCEL_WARMUP=0, a device where nothing compiles, kernels that cannot run here (the
    startup line said why), or these shapes done already in this process."""
    if os.environ.get(ENV, "1").strip() == "0" or not _compiles_on(device) or kernels_unavailable() is not None:
        return None
    key = (num_heads, num_kv_heads, head_dim, dtype, page_size, config, chunk_tokens, str(device))
    if key in _done:
        return None
    _done.add(key)
    from ..api import sparse_prefill_attention

    contexts = warmup_contexts(chunk_tokens, config)
    generator = torch.Generator(device=device).manual_seed(0)
    for context in contexts:
        pages = -(-context // page_size)
        k_cache, v_cache = (torch.randn(pages, page_size, num_kv_heads, head_dim, generator=generator, device=device,
                                        dtype=torch.float32).to(dtype) for _ in range(2))  # fmt: skip
        q = torch.randn(chunk_tokens, num_heads, head_dim, generator=generator, device=device, dtype=torch.float32)
        q = q.to(dtype)
        page_table = torch.arange(pages, dtype=torch.int32, device=device).view(1, -1)
        cu_q, k_lens = torch.tensor([0, chunk_tokens], dtype=torch.int32), torch.tensor([context], dtype=torch.int32)
        layout = BatchLayout.build(cu_q, k_lens, config, device)
        sparse_prefill_attention(q, k_cache, v_cache, page_table, cu_q.to(device), k_lens.to(device), config=config,
                                 out=torch.empty_like(q), layout=layout)  # fmt: skip
        del q, k_cache, v_cache
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return contexts


def warm_up_logged(logger, describe: str, **shapes) -> None:
    """warm_up() for an engine adapter: one INFO line with what was compiled and how long it took, or
    one WARNING when it failed (the kernels then compile at the first long prompt, as without it)."""
    start = time.perf_counter()
    try:
        contexts = warm_up(**shapes)
    except Exception as error:  # noqa: BLE001 - startup must go on; the first long prompt compiles instead
        logger.warning("prefill-accel: compiling the kernels ahead failed (%s: %s); they compile at the first "
                       "long prompt instead", type(error).__name__, error)  # fmt: skip
        return
    if contexts:
        logger.info("prefill-accel: compiled and tuned the sparse kernels for %s, chunks of %d tokens at contexts "
                    "%s, in %.1f s (%s=0 skips this)", describe, shapes["chunk_tokens"],
                    ", ".join(map(str, contexts)), time.perf_counter() - start, ENV)  # fmt: skip
