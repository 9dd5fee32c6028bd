"""Public entry points: validate inputs, route to the Triton kernels or the dense fallback."""

from __future__ import annotations

import math
import os
import warnings

import torch

from . import stats
from .config import SUPPORTED_HEAD_DIMS, SparsePrefillConfig
from .dense_route import CUDNN_ROUTE
from .layout import BatchLayout, BlockIndex, causal_block_count
from .ops import attention_reference, search_reference

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"prefill_accel: {reason}; using the dense PyTorch path", RuntimeWarning, stacklevel=3)


def _check_inputs(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, out) -> None:
    """Errors for inputs that no path can compute: wrong ranks, mismatched shapes or lengths."""
    if q.dim() != 3:
        raise ValueError(f"q must be (total_q, num_q_heads, head_dim), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be (num_pages, page_size, num_kv_heads, head_dim), "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor (fp16/bf16 for the kernels), got {t.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of the KV cache ({k_cache.shape[3]}) differ")
    if num_kv == 0 or num_heads % num_kv:
        raise ValueError(f"num_q_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv})")
    if page_table.dim() != 2 or cu_seqlens_q.dim() != 1 or seqlens_k.dim() != 1:
        raise ValueError("page_table must be (batch, max_pages), cu_seqlens_q (batch+1,), seqlens_k (batch,)")
    batch = seqlens_k.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1 or page_table.shape[0] != batch:
        raise ValueError(
            f"batch sizes disagree: seqlens_k has {batch}, cu_seqlens_q {cu_seqlens_q.shape[0]} (needs batch+1), "
            f"page_table {page_table.shape[0]} rows"
        )
    for name, t in (("page_table", page_table), ("cu_seqlens_q", cu_seqlens_q), ("seqlens_k", seqlens_k)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 (or int64), got {t.dtype}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(
            f"out must match q: shape {tuple(q.shape)}, dtype {q.dtype}, device {q.device}; "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )


def _check_pages(longest: int, page_size: int, page_table: torch.Tensor) -> None:
    pages_needed = -(-longest // page_size)
    if pages_needed > page_table.shape[1]:
        raise ValueError(
            f"page_table has {page_table.shape[1]} columns but the longest sequence needs {pages_needed} pages"
        )


def _host_lengths(cu_seqlens_q, seqlens_k, page_table, num_pages: int, page_size: int, total_q: int):
    """The two length tensors on the host, checked, with the page ids checked in the same read from the device."""
    faults = _page_id_faults(page_table, seqlens_k, num_pages, page_size)
    if cu_seqlens_q.device == seqlens_k.device == faults.device:
        both = torch.cat((cu_seqlens_q.long(), seqlens_k.long(), faults)).cpu()
        cu_host, k_host, fault_count = both[: cu_seqlens_q.shape[0]], both[cu_seqlens_q.shape[0] : -1], both[-1]
    else:
        cu_host, k_host, fault_count = cu_seqlens_q.cpu(), seqlens_k.cpu(), faults.cpu()[0]
    cu_q = cu_host.tolist()
    if cu_q[0] != 0 or cu_q[-1] != total_q or any(b < a for a, b in zip(cu_q, cu_q[1:])):
        raise ValueError(f"cu_seqlens_q must rise from 0 to total_q={total_q}, got {cu_q}")
    for seq, (q_len, k_len) in enumerate(zip(torch.diff(cu_host).tolist(), k_host.tolist())):
        if q_len > k_len:
            raise ValueError(
                f"sequence {seq}: query length {q_len} exceeds seqlens_k={k_len} "
                "(queries are the last q_len positions of the sequence)"
            )
    _check_pages(int(k_host.max()) if k_host.numel() else 0, page_size, page_table)
    if fault_count:
        _raise_page_id_fault(page_table, seqlens_k, num_pages, page_size)
    return cu_host, k_host


def _outside_pages(page_table, seqlens_k, num_pages: int, page_size: int):
    """(batch, max_pages) bool mask of the entries a sequence uses (the first ceil(seqlens_k / page_size)
    of its row) that are no page of the cache, outside [0, num_pages), and the pages each sequence uses."""
    pages_used = (seqlens_k.to(page_table.device).long() + page_size - 1) // page_size
    used = torch.arange(page_table.shape[1], device=page_table.device) < pages_used[:, None]
    return ((page_table < 0) | (page_table >= num_pages)) & used, pages_used


def _page_id_faults(page_table, seqlens_k, num_pages: int, page_size: int) -> torch.Tensor:
    """(1,) int64 on the page table's device: how many used entries are no page of the cache. Queued, not read."""
    return _outside_pages(page_table, seqlens_k, num_pages, page_size)[0].sum().view(1)


def _raise_page_id_fault(page_table, seqlens_k, num_pages: int, page_size: int):
    outside, pages_used = _outside_pages(page_table, seqlens_k, num_pages, page_size)
    seq, column = outside.nonzero()[0].tolist()
    raise ValueError(
        f"page_table[{seq}, {column}] = {int(page_table[seq, column])} is no page of the KV cache "
        f"(it has {num_pages} pages); sequence {seq} uses the first {int(pages_used[seq])} entries of its row"
    )


def _check_page_ids(layout: BatchLayout, page_table, seqlens_k, num_pages: int, page_size: int) -> None:
    """The page-id check for a caller's layout: once per layout and page table (every layer of a step
    passes the same ones), at the cost of one read from the device."""
    key = (page_table.data_ptr(), tuple(page_table.shape), num_pages, page_size)
    if key in layout.checked_page_tables:
        return
    if int(_page_id_faults(page_table, seqlens_k, num_pages, page_size).item()):
        _raise_page_id_fault(page_table, seqlens_k, num_pages, page_size)
    layout.checked_page_tables.add(key)


def _unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot take these inputs, or None when they can."""
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype != q.dtype:
        return f"dtype q={q.dtype}, cache={k_cache.dtype} is not supported by the kernels (fp16/bf16, equal)"
    if q.shape[2] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {q.shape[2]} is not supported by the kernels ({SUPPORTED_HEAD_DIMS})"
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"device {q.device.type} has no Triton backend (set TRITON_INTERPRET=1 to run the kernels on CPU)"
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        return "the last dimension of q and of the KV cache must be contiguous"
    return None


def _prepare(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, out, config):
    """Check the call; returns host copies of the length tensors, to build the layout from."""
    _check_inputs(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, out)
    if not isinstance(config, SparsePrefillConfig):
        raise TypeError(f"config must be a SparsePrefillConfig, got {type(config).__name__}")
    return _host_lengths(cu_seqlens_q, seqlens_k, page_table, k_cache.shape[0], k_cache.shape[1], q.shape[0])


def _check_layout(layout: BatchLayout, q, k_cache, page_table, seqlens_k, config: SparsePrefillConfig) -> None:
    """What can be checked of a caller's layout without reading device tensors."""
    if not isinstance(layout, BatchLayout):
        raise TypeError(f"layout must be a BatchLayout, got {type(layout).__name__}")
    if layout.config != config:
        raise ValueError("layout was built for another SparsePrefillConfig")
    if layout.batch != seqlens_k.shape[0] or sum(layout.q_lens) != q.shape[0]:
        raise ValueError(
            f"layout describes {layout.batch} sequences of {sum(layout.q_lens)} query tokens; "
            f"the call has {seqlens_k.shape[0]} sequences of {q.shape[0]}"
        )
    if layout.qblock_pos.device != q.device:
        raise ValueError(f"layout tensors are on {layout.qblock_pos.device}, q on {q.device}")
    _check_pages(max(layout.k_lens, default=0), k_cache.shape[1], page_table)
    _check_page_ids(layout, page_table, seqlens_k, k_cache.shape[0], k_cache.shape[1])


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(q.shape[2])
    if not 0 < softmax_scale < math.inf:  # the kernels take the row maximum of unscaled scores
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(softmax_scale)


def _dense_fallback(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, scale, out):
    o, lse = attention_reference.dense_paged_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, scale)
    if out is None:
        out = torch.empty_like(q)
    out.copy_(o.to(q.dtype))
    return out, lse


def sparse_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    config: SparsePrefillConfig = SparsePrefillConfig(),
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    layout: BatchLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal block-sparse prefill attention over a paged KV cache: block selection, then attention.

    Args:
        q: (total_q, num_q_heads, head_dim), this step's queries of a batch of sequences packed
            by ``cu_seqlens_q``. A sequence's queries are its last q_len positions.
        k_cache, v_cache: (num_pages, page_size, num_kv_heads, head_dim), a paged cache already
            holding this step's keys and values. num_q_heads must be a multiple of num_kv_heads.
        page_table: (batch, max_pages) int32, the pages of each sequence in order.
        cu_seqlens_q: (batch + 1,) int32, query offsets of the sequences in ``q``.
        seqlens_k: (batch,) int32, each sequence's total KV length including this step, so
            prefix_len = seqlens_k - q_len (chunked prefill, prefix caching).
        config: the block search; ``threshold=0`` is exact dense attention.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        out: optional preallocated output shaped and typed like ``q``.
        layout: optional ``BatchLayout.build(cu_seqlens_q, seqlens_k, config, q.device)`` built by the
            caller, from host copies of the two length tensors. An engine builds it once per step
            and passes it to every layer, so no layer reads lengths back from the device (without
            it, each call waits for the device once to read them). It must describe these lengths;
            only the batch size, the total query length and the configuration are checked.

    Returns:
        ``out`` (total_q, num_q_heads, head_dim) in q's dtype and ``lse`` (num_q_heads, total_q)
        float32, the natural-log sum-exp of the scaled scores each query attended to.

    Inputs the kernels do not support (dtype, head_dim, device, layout) are computed by the dense
    PyTorch reference, with one warning per reason.
    """
    if layout is None:
        host_lengths = _prepare(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, out, config)
    else:
        _check_inputs(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, out)
        _check_layout(layout, q, k_cache, page_table, seqlens_k, config)
    scale = _scale(q, softmax_scale)
    reason = _unsupported_reason(q, k_cache)
    if reason is not None:
        _warn_once(reason)
        return _dense_fallback(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, scale, out)
    from .ops import attention, search

    if layout is None:
        cu_q, k_lens = host_lengths[0].tolist(), host_lengths[1].tolist()
        q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    else:
        q_lens, k_lens = layout.q_lens, layout.k_lens
    recorder = stats.recorder()
    clock = recorder.start(q.device) if recorder is not None else None
    index = result = None
    if CUDNN_ROUTE.applies(q, config, q_lens, k_lens):
        result = CUDNN_ROUTE(q, k_cache, v_cache, page_table, q_lens, scale, out)
    if result is None:
        if layout is None:
            layout = BatchLayout.build(*host_lengths, config, q.device)
        if not layout.all_dense:
            index = search.select_blocks(q, k_cache, page_table, cu_seqlens_q, seqlens_k, layout, config, scale)
    select_ms = clock.lap() if clock is not None else 0.0
    if result is None:
        result = attention.block_sparse_attention(
            q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, layout, index, scale, config.mean_correction, out
        )
    if recorder is not None:
        causal = causal_block_count(q_lens, k_lens, config.block_size) * k_cache.shape[2]
        kept = causal if index is None else int(index.counts.long().sum().item())
        recorder.record(q.shape[0], kept, causal, select_ms, clock.lap())
    return result


def select_blocks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    config: SparsePrefillConfig = SparsePrefillConfig(),
    softmax_scale: float | None = None,
) -> BlockIndex:
    """Stage 1: the block index (kept key blocks per query block and KV head, with the estimates).

    Shapes as in :func:`sparse_prefill_attention`. Unsupported inputs use the PyTorch reference search.
    """
    host_lengths = _prepare(q, k_cache, k_cache, page_table, cu_seqlens_q, seqlens_k, None, config)
    scale = _scale(q, softmax_scale)
    reason = _unsupported_reason(q, k_cache)
    if reason is not None:
        _warn_once(reason)
        return search_reference.select_blocks(q, k_cache, page_table, cu_seqlens_q, seqlens_k, config, scale)
    from .ops import search

    layout = BatchLayout.build(*host_lengths, config, q.device)
    return search.select_blocks(q, k_cache, page_table, cu_seqlens_q, seqlens_k, layout, config, scale)


def block_sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    index: BlockIndex,
    softmax_scale: float | None = None,
    mean_correction: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: causal attention over the key blocks ``index`` keeps (reusable across layers/steps).

    Shapes and returns as in :func:`sparse_prefill_attention`; ``index`` must come from a search
    over the same batch layout and the same number of KV heads.
    """
    _check_inputs(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, out)
    layout = index.layout
    if layout.q_lens != tuple(torch.diff(cu_seqlens_q).tolist()) or layout.k_lens != tuple(seqlens_k.tolist()):
        raise ValueError("index was built for another batch layout (sequence lengths differ)")
    _check_page_ids(layout, page_table, seqlens_k, k_cache.shape[0], k_cache.shape[1])
    if index.num_kv_heads != k_cache.shape[2]:
        raise ValueError(f"index has {index.num_kv_heads} KV heads, the cache {k_cache.shape[2]}")
    scale = _scale(q, softmax_scale)
    reason = _unsupported_reason(q, k_cache)
    if reason is not None:
        _warn_once(reason)
        o, lse = attention_reference.block_masked_attention(
            q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, index, scale, mean_correction
        )
        out = torch.empty_like(q) if out is None else out
        out.copy_(o.to(q.dtype))
        return out, lse
    from .ops import attention

    return attention.block_sparse_attention(
        q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, layout, index, scale, mean_correction, out
    )
