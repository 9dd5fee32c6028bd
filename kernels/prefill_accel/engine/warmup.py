"""Compile and tune the kernels for an engine's shapes before its first request.

A Triton kernel compiles at its first launch with new compile-time arguments, and the attention
kernel times its tile shapes once per autotuning key: left to the first long prompt, a server pays
seconds of compilation inside that request. An engine's chunks come in few shapes (its head counts,
head size, page size and chunk length are fixed at startup; the kernels leave batch lengths
unspecialised, ops.common.jit_per_batch), so a few calls compile and tune what serving launches:
the sparse path per autotuning class of the chunks a step holds, at the shortest context it takes
them and where it reads K/V with bulk tensor copies (past TMA_SPARSE_MIN_KEYS keys); the dense path
of a short chunk after a prefix (its long row split over programs); a fresh short prompt (cuDNN, over
K/V gathered out of the pages). Scratch tensors, freed afterwards; the engine's own cache is not touched.
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


def warmup_cases(chunk_tokens: int, config: SparsePrefillConfig, num_heads: int,
                 max_context: int | None = None) -> list[tuple[int, int]]:  # fmt: skip
    """The (query, key) lengths of one sequence to warm up chunks of up to ``chunk_tokens`` queries at,
    within ``max_context`` keys (None: any); none when such chunks never take the sparse path there.

    Sparse, for each autotuning class (launch.size_class) of the chunks up to ``chunk_tokens``: the
    longest chunk of the class at the shortest context that takes it sparse and, where that is
    shorter, at launch.TMA_SPARSE_MIN_KEYS keys (bulk K/V reads). Then the dense path: a
    one-token chunk after a ``chunk_tokens`` prefix, a chunk of each class that stays dense after a
    one-token prefix, and a fresh prompt of one block."""
    from ..ops.launch import SIZE_CLASS_BOUNDS, TMA_SPARSE_MIN_KEYS, size_class

    def fits(k_len: int) -> bool:
        return max_context is None or k_len <= max_context

    block = config.block_size
    sizes = {}  # the longest chunk of each size class, up to chunk_tokens
    for q_len in [chunk_tokens] + [(bound // num_heads - 1) * block for bound in SIZE_CLASS_BOUNDS]:
        if block <= q_len <= chunk_tokens:
            sizes.setdefault(size_class(-(-q_len // block) * num_heads), q_len)
    sparse = []
    for q_len in sizes.values():
        start = config.sparse_from(q_len)
        if start is None or not fits(start):
            continue
        sparse.append((q_len, start))
        if start < TMA_SPARSE_MIN_KEYS and fits(TMA_SPARSE_MIN_KEYS):
            sparse.append((q_len, TMA_SPARSE_MIN_KEYS))
    if not sparse:
        return []
    dense = [(1, chunk_tokens + 1)] if fits(chunk_tokens + 1) else []
    dense += [(q_len, q_len + 1) for q_len in sizes.values() if not config.long_chunk(q_len, q_len + 1) and fits(q_len + 1)]
    if not config.long_chunk(block):
        dense.append((block, block))
    return sparse + list(dict.fromkeys(dense))


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int,
            config: SparsePrefillConfig, chunk_tokens: int, device: torch.device,
            max_context: int | None = None) -> list[tuple[int, int]] | None:  # fmt: skip
    """Run the public function once for each of warmup_cases() with these shapes, as an engine calls it
    (a prebuilt layout, a preallocated output). Returns the cases run, or None where nothing ran:
    PREFILL_ACCEL_WARMUP=0, a device where nothing compiles, kernels that cannot run here (the
    startup line said why), or these shapes done already in this process."""
    if os.environ.get(ENV, "1").strip() == "0" or not _compiles_on(device) or kernels_unavailable() is not None:
        return None
    key = (num_heads, num_kv_heads, head_dim, dtype, page_size, config, chunk_tokens, max_context, str(device))
    if key in _done:
        return None
    _done.add(key)
    from ..api import sparse_prefill_attention

    cases = warmup_cases(chunk_tokens, config, num_heads, max_context)
    generator = torch.Generator(device=device).manual_seed(0)
    for q_len, k_len in cases:
        pages = -(-k_len // page_size)
        k_cache, v_cache = (torch.randn(pages, page_size, num_kv_heads, head_dim, generator=generator, device=device,
                                        dtype=torch.float32).to(dtype) for _ in range(2))  # fmt: skip
        q = torch.randn(q_len, num_heads, head_dim, generator=generator, device=device, dtype=torch.float32)
        q = q.to(dtype)
        page_table = torch.arange(pages, dtype=torch.int32, device=device).view(1, -1)
        cu_q, k_lens = torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([k_len], dtype=torch.int32)
        layout = BatchLayout.build(cu_q, k_lens, config, device)
        sparse_prefill_attention(q, k_cache, v_cache, page_table, cu_q.to(device), k_lens.to(device), config=config,
                                 out=torch.empty_like(q), layout=layout)  # fmt: skip
        del q, k_cache, v_cache
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return cases


def warm_up_logged(logger, describe: str, **shapes) -> None:
    """warm_up() for an engine adapter: one INFO line with what was compiled and how long it took, or
    one WARNING when it failed (the kernels then compile at the first long prompt, as without it)."""
    start = time.perf_counter()
    try:
        cases = warm_up(**shapes)
    except Exception as error:  # noqa: BLE001 - startup must go on; the first long prompt compiles instead
        logger.warning("prefill-accel: compiling the kernels ahead failed (%s: %s); they compile at the first "
                       "long prompt instead", type(error).__name__, error)  # fmt: skip
        return
    if cases:
        logger.info("prefill-accel: compiled and tuned the kernels for %s, chunks of up to %d tokens, at (query, "
                    "key) lengths %s, in %.1f s (%s=0 skips this)", describe, shapes["chunk_tokens"],
                    " ".join(f"{q}/{k}" for q, k in cases), time.perf_counter() - start, ENV)  # fmt: skip
