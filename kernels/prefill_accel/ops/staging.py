"""Copies of K/V out of the paged cache: the staged pages that the attention kernel's bulk tensor
copies (TMA) read when the cache's own pages are narrower than a key tile, the TMA descriptors,
and the per-sequence gather of the cuDNN dense route. The reference is staging_reference.py."""

import torch
import triton
import triton.language as tl

from ..layout import BatchLayout
from .common import TensorDescriptor, jit_per_batch, kv_slots


@jit_per_batch("page_table", "seqlens_k", "stride_pt", "kv_head_base")
def _stage_kernel(
    k_cache, v_cache, page_table, seqlens_k, stage_seq, stage_block, k_staged, v_staged,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt, stride_sp, stride_sr, stride_sh,
    kv_head_base, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Copy key block ``stage_block[p]`` of sequence ``stage_seq[p]`` (K and V of one KV head) into
    staged page ``p``. Positions past the sequence repeat its last row, so the page holds finite values."""
    page_out = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(stage_seq + page_out)
    first = tl.load(stage_block + page_out) * BLOCK
    last = tl.load(seqlens_k + seq) - 1
    pt_row = page_table + seq.to(tl.int64) * stride_pt
    dims = tl.arange(0, HEAD_DIM)
    kv_head = kv_head_base + head
    for c in range(0, BLOCK, CHUNK):
        rows = c + tl.arange(0, CHUNK)
        page, slot = kv_slots(pt_row, tl.minimum(first + rows, last), PAGE_SIZE, None)
        staged = (page_out.to(tl.int64) * stride_sp + rows * stride_sr + head * stride_sh)[:, None] + dims[None, :]
        keys = tl.load(k_cache + (page * stride_kp + slot * stride_ks + kv_head * stride_kh)[:, None] + dims[None, :])
        tl.store(k_staged + staged, keys)
        values = tl.load(v_cache + (page * stride_vp + slot * stride_vs + kv_head * stride_vh)[:, None] + dims[None, :])
        tl.store(v_staged + staged, values)


def stage_kv(k_cache, v_cache, page_table, seqlens_k, layout: BatchLayout, kv_heads: range):
    """K and V of ``kv_heads`` copied out of the pages into (layout.staging.pages, block, heads,
    head_dim) tensors, one page per key block, for the bulk tensor copies (TMA) of the attention
    kernel when the cache's own pages are smaller than a key tile. Costs one read and one write of
    the step's keys and values, against attention's quadratic work; STAGE_BYTES bounds one copy."""
    staging, block, head_dim = layout.staging, layout.block_size, k_cache.shape[3]
    shape = (staging.pages, block, len(kv_heads), head_dim)
    k_staged = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    v_staged = torch.empty_like(k_staged)
    if staging.pages:
        _stage_kernel[(staging.pages, len(kv_heads))](
            k_cache, v_cache, page_table, seqlens_k, staging.seq, staging.block, k_staged, v_staged,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), page_table.stride(0), k_staged.stride(0), k_staged.stride(1), k_staged.stride(2),
            kv_heads.start, PAGE_SIZE=k_cache.shape[1], BLOCK=block, HEAD_DIM=head_dim, CHUNK=min(block, 32),
        )  # fmt: skip
    return k_staged, v_staged


@jit_per_batch("page_table_row", "length")
def _gather_kernel(
    k_cache, v_cache, page_table_row, k_out, v_out, length, stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Copy positions [ROWS * program_id(0), + ROWS) of one sequence's keys and values of KV head
    ``program_id(1)`` out of the pages into row-major (heads, length, HEAD_DIM) tensors. Loads its own
    tiles rather than through kv_tile: masked rows need no fill value here, and it ran faster so
    (docs/benchmarks.md, One launch for the gather)."""
    head = tl.program_id(1)
    pos = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = pos < length
    page, slot = kv_slots(page_table_row, pos, PAGE_SIZE, valid)
    dims = tl.arange(0, HEAD_DIM)
    # Rows of (heads, length, HEAD_DIM) storage: a multiple of HEAD_DIM apart, whatever the length.
    gathered = ((head.to(tl.int64) * length + pos) * HEAD_DIM)[:, None] + dims[None, :]
    keys = tl.load(k_cache + (page * stride_kp + slot * stride_ks + head * stride_kh)[:, None] + dims[None, :], mask=valid[:, None])
    tl.store(k_out + gathered, keys, mask=valid[:, None])
    values = tl.load(v_cache + (page * stride_vp + slot * stride_vs + head * stride_vh)[:, None] + dims[None, :], mask=valid[:, None])
    tl.store(v_out + gathered, values, mask=valid[:, None])


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, seq: int, length: int):
    """The first ``length`` keys and values of sequence ``seq``, one launch for both: each a (length,
    num_kv_heads, head_dim) view of row-major (num_kv_heads, length, head_dim) storage, the layout
    cuDNN attention reads at least as fast as any other (docs/benchmarks.md, One launch for the gather)."""
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_out = torch.empty(num_kv, length, head_dim, dtype=k_cache.dtype, device=k_cache.device)
    v_out = torch.empty_like(k_out)
    rows = 8192 // head_dim  # a 16 KB tile at 16 bits
    if length:
        _gather_kernel[(triton.cdiv(length, rows), num_kv)](
            k_cache, v_cache, page_table[seq], k_out, v_out, length, k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, ROWS=rows,
        )  # fmt: skip
    return k_out.transpose(0, 1), v_out.transpose(0, 1)


def pages_hold_tiles(cache: torch.Tensor) -> bool:
    """Whether TMA can read key tiles straight from the cache: pages of a multiple of 64 rows (the
    narrowest TMA tile at head_dim <= 128), one page after another, heads side by side in a row."""
    pages, page_size, heads, head_dim = cache.shape
    return (
        page_size % 64 == 0
        and cache.stride(3) == 1
        and cache.stride(2) == head_dim
        and cache.stride(0) == page_size * cache.stride(1)
        and cache.stride(1) * cache.element_size() % 16 == 0
        and cache.data_ptr() % 16 == 0
    )


def descriptor(cache: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over a (pages, page_size, heads, head_dim) cache seen as (rows, heads * head_dim);
    the kernel (or its autotuning pre-hook) sets the block shape."""
    pages, page_size, heads, head_dim = cache.shape
    return TensorDescriptor(cache, [pages * page_size, heads * head_dim], [cache.stride(1), 1], [64, head_dim])
