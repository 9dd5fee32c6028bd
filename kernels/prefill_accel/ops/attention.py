"""Block-sparse FlashAttention over a paged cache: one program per tile of queries and query head
walks the key blocks the search kept (every causal block in dense mode), the diagonal block
masked causally, optionally the pruned blocks through their mean key and value; long dense rows
split over several programs and merged (split-KV). The reference is attention_reference.py."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..layout import BatchLayout, BlockIndex
from . import launch, staging
from .common import INTERPRET, LOG2E, dot, jit_per_batch, kv_tile
from .search import pool_blocks


@triton.jit
def _query_tile(qblock_seq, qblock_pos, cu_seqlens_q, seqlens_k, qb, sub, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Where tile ``sub`` of query block ``qb`` lies: its sequence, block position, key length, the
    queries' absolute positions and which of them belong to this step, their packed rows, and the
    position of its last query (clipped to the sequence)."""
    seq = tl.load(qblock_seq + qb)
    pos = tl.load(qblock_pos + qb)
    k_len = tl.load(seqlens_k + seq)
    q_start = tl.load(cu_seqlens_q + seq)
    prefix = k_len - (tl.load(cu_seqlens_q + seq + 1) - q_start)
    q_pos = pos * BLOCK + sub * BLOCK_M + tl.arange(0, BLOCK_M)
    q_valid = (q_pos >= prefix) & (q_pos < k_len)
    q_rows = (q_start + q_pos - prefix).to(tl.int64)
    last_row = tl.minimum(pos * BLOCK + (sub + 1) * BLOCK_M, k_len) - 1
    return seq, pos, k_len, prefix, q_pos, q_valid, q_rows, last_row


@triton.jit
def _attend_kept(
    q_tile, k_cache, v_cache, k_desc, v_desc, pt_row, indices, index_row, t_start, t_end, kv_head, kv_column,
    row_max, row_sum, acc, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr, DENSE: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """Online softmax over key tiles ``t_start .. t_end`` of the kept blocks below the diagonal
    (``indices`` row ``index_row``; every block when DENSE), which need no causal mask."""
    SUB_N: tl.constexpr = BLOCK // BLOCK_N
    for t in range(t_start, t_end):
        if DENSE:
            k_first = t * BLOCK_N
        else:
            block = tl.load(indices + index_row + t // SUB_N)
            k_first = block * BLOCK + (t % SUB_N) * BLOCK_N
        keys = kv_tile(k_cache, k_desc, pt_row, k_first, kv_head, kv_column, stride_kp, stride_ks, stride_kh, None,
                        HEAD_DIM, PAGE_SIZE, BLOCK_N, TMA)  # fmt: skip
        scores = dot(q_tile, tl.trans(keys))  # unscaled: the scale folds into the exponent's FMA below
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * qk_scale)
        probs = tl.exp2(scores * qk_scale - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None]
        values = kv_tile(v_cache, v_desc, pt_row, k_first, kv_head, kv_column, stride_vp, stride_vs, stride_vh, None,
                          HEAD_DIM, PAGE_SIZE, BLOCK_N, TMA)  # fmt: skip
        acc += dot(probs.to(values.dtype), values)
        row_max = new_max
    return row_max, row_sum, acc


@triton.jit
def _online_softmax_step(logits, values, row_max, row_sum, acc):
    """Fold one tile of scaled base-2 logits (-inf where masked) and its values into the running row
    maximum, row sum and unnormalised accumulator."""
    new_max = tl.maximum(row_max, tl.max(logits, axis=1))
    probs = tl.exp2(logits - new_max[:, None])
    rescale = tl.exp2(row_max - new_max)
    row_sum = row_sum * rescale + tl.sum(probs, axis=1)
    acc = acc * rescale[:, None]
    acc += dot(probs.to(values.dtype), values)
    return new_max, row_sum, acc


@triton.jit
def _attend_diagonal(
    q_tile, q_pos, pos, last_row, k_len, k_cache, v_cache, k_desc, v_desc, pt_row, kv_head, kv_column,
    row_max, row_sum, acc, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Online softmax over the diagonal block up to ``last_row``, masked causally."""
    cols = tl.arange(0, BLOCK_N)
    for k_first in range(pos * BLOCK, last_row + 1, BLOCK_N):
        k_pos = k_first + cols
        k_valid = k_pos < k_len
        keys = kv_tile(k_cache, k_desc, pt_row, k_first, kv_head, kv_column, stride_kp, stride_ks, stride_kh, k_valid,
                        HEAD_DIM, PAGE_SIZE, BLOCK_N, TMA)  # fmt: skip
        logits = dot(q_tile, tl.trans(keys)) * qk_scale
        logits = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :], logits, float("-inf"))
        values = kv_tile(v_cache, v_desc, pt_row, k_first, kv_head, kv_column, stride_vp, stride_vs, stride_vh, k_valid,
                          HEAD_DIM, PAGE_SIZE, BLOCK_N, TMA)  # fmt: skip
        if TMA:  # rows past the sequence hold whatever the page holds: keep them out of 0 * value
            values = tl.where(k_valid[:, None], values, 0.0)
        row_max, row_sum, acc = _online_softmax_step(logits, values, row_max, row_sum, acc)
    return row_max, row_sum, acc


@triton.autotune(
    configs=launch.attention_configs(),
    key=["HEAD_DIM", "BLOCK", "PAGE_SIZE", "DENSE", "GROUP", "TMA", "size_class"],
    prune_configs_by={"early_config_prune": launch.prune_attention_configs},
)
@jit_per_batch("page_table", "cu_seqlens_q", "seqlens_k", "stride_pt", "stride_lh", "stride_ir", "stride_ih",
               "total_q_blocks", "kv_head_base")  # fmt: skip
def _attention_kernel(
    q,
    k_cache,
    v_cache,
    k_desc,
    v_desc,
    page_table,
    cu_seqlens_q,
    seqlens_k,
    qblock_seq,
    qblock_pos,
    counts,
    indices,
    keep_mask,
    pooled_k,
    pooled_v,
    split_rows,
    out,
    lse,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ot,
    stride_oh,
    stride_lh,
    stride_ir,
    stride_ih,
    stride_cr,
    stride_pb,
    stride_pj,
    stride_ph,
    total_q_blocks,
    kv_head_base,
    qk_scale,
    size_class,  # autotuning key only (_size_class)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DENSE: tl.constexpr,
    MEAN_CORRECTION: tl.constexpr,
    SPLIT: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One tile of BLOCK_M queries of one query head: online-softmax attention over the kept key
    blocks (all causal blocks when DENSE), the diagonal block masked causally, then optionally the
    pruned fully visible blocks through their mean key and value. Writes out and natural-log lse.
    With SPLIT, query blocks flagged in ``split_rows`` are left to the split-KV kernels. The launch
    covers the query heads of KV heads ``kv_head_base ..``; with TMA, K and V come through
    ``k_desc``/``v_desc``, whose columns start at KV head ``kv_head_base``."""
    SUB_M: tl.constexpr = BLOCK // BLOCK_M
    SUB_N: tl.constexpr = BLOCK // BLOCK_N
    # Query heads vary fastest across programs, so the heads of a KV group, which keep the same
    # blocks, run side by side and share K/V tiles in L2; the heaviest (latest) query blocks start first.
    launch_heads = tl.num_programs(0) // (total_q_blocks * SUB_M)
    head = kv_head_base * GROUP + tl.program_id(0) % launch_heads
    tile = tl.program_id(0) // launch_heads
    kv_head = head // GROUP
    kv_column = (kv_head - kv_head_base) * HEAD_DIM
    qb = total_q_blocks - 1 - tile // SUB_M
    sub = tile % SUB_M
    seq, pos, k_len, prefix, q_pos, q_valid, q_rows, last_row = _query_tile(
        qblock_seq, qblock_pos, cu_seqlens_q, seqlens_k, qb, sub, BLOCK, BLOCK_M
    )
    todo = (last_row >= prefix) & (pos * BLOCK + sub * BLOCK_M < k_len)
    if SPLIT:
        todo = todo & (tl.load(split_rows + qb) == 0)
    if todo:
        dims = tl.arange(0, HEAD_DIM)
        cols = tl.arange(0, BLOCK_N)
        q_tile = tl.load(q + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_valid[:, None], other=0.0)
        pt_row = page_table + seq.to(tl.int64) * stride_pt
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        index_row = qb.to(tl.int64) * stride_ir + kv_head * stride_ih

        if DENSE:
            n_tiles = pos * SUB_N
        else:
            n_tiles = (tl.load(counts + qb * stride_cr + kv_head) - 1) * SUB_N
        row_max, row_sum, acc = _attend_kept(
            q_tile, k_cache, v_cache, k_desc, v_desc, pt_row, indices, index_row, 0, n_tiles, kv_head, kv_column,
            row_max, row_sum, acc, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            HEAD_DIM, BLOCK, PAGE_SIZE, DENSE, BLOCK_N, TMA,
        )  # fmt: skip
        row_max, row_sum, acc = _attend_diagonal(
            q_tile, q_pos, pos, last_row, k_len, k_cache, v_cache, k_desc, v_desc, pt_row, kv_head, kv_column,
            row_max, row_sum, acc, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            HEAD_DIM, BLOCK, PAGE_SIZE, BLOCK_N, TMA,
        )  # fmt: skip

        if MEAN_CORRECTION:
            pooled_row = seq.to(tl.int64) * stride_pb + kv_head * stride_ph
            for j0 in range(0, pos, BLOCK_N):
                j = j0 + cols
                pruned = (j < pos) & (tl.load(keep_mask + index_row + j, mask=j < pos, other=1) == 0)
                mean_k = tl.load(pooled_k + pooled_row + j[:, None] * stride_pj + dims[None, :], mask=pruned[:, None], other=0.0)
                logits = dot(q_tile, tl.trans(mean_k.to(q_tile.dtype))) * qk_scale + math.log2(BLOCK)
                logits = tl.where(pruned[None, :], logits, float("-inf"))
                mean_v = tl.load(pooled_v + pooled_row + j[:, None] * stride_pj + dims[None, :], mask=pruned[:, None], other=0.0)
                row_max, row_sum, acc = _online_softmax_step(logits, mean_v, row_max, row_sum, acc)

        acc = acc / row_sum[:, None]
        tl.store(out + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :], acc.to(out.dtype.element_ty), mask=q_valid[:, None])
        tl.store(lse + head * stride_lh + q_rows, (row_max + tl.log2(row_sum)) / 1.4426950408889634, mask=q_valid)


@jit_per_batch("page_table", "cu_seqlens_q", "seqlens_k", "stride_pt", "stride_ir", "stride_ih", "num_long_rows",
               "blocks_per_split")  # fmt: skip
def _split_attention_kernel(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_seqlens_q,
    seqlens_k,
    qblock_seq,
    qblock_pos,
    counts,
    indices,
    long_rows,
    part_acc,
    part_max,
    part_sum,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ir,
    stride_ih,
    stride_cr,
    num_long_rows,
    blocks_per_split,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Split-KV for long rows: one tile of BLOCK_M queries of one head of query block
    ``long_rows[r]``, over its kept blocks ``split * blocks_per_split ..`` (the diagonal in split 0).
    Writes the unnormalised accumulator, row maximum (base 2) and row sum for _merge_splits_kernel."""
    SUB_M: tl.constexpr = BLOCK // BLOCK_M
    SUB_N: tl.constexpr = BLOCK // BLOCK_N
    num_heads = tl.num_programs(0) // (num_long_rows * SUB_M)
    head = tl.program_id(0) % num_heads
    tile = tl.program_id(0) // num_heads
    split = tl.program_id(1)
    kv_head = head // GROUP
    r = tile // SUB_M
    sub = tile % SUB_M
    qb = tl.load(long_rows + r)
    seq, pos, k_len, prefix, q_pos, q_valid, q_rows, last_row = _query_tile(
        qblock_seq, qblock_pos, cu_seqlens_q, seqlens_k, qb, sub, BLOCK, BLOCK_M
    )
    dims = tl.arange(0, HEAD_DIM)
    q_tile = tl.load(q + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=q_valid[:, None], other=0.0)
    pt_row = page_table + seq.to(tl.int64) * stride_pt
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    index_row = qb.to(tl.int64) * stride_ir + kv_head * stride_ih
    kept = tl.load(counts + qb * stride_cr + kv_head) - 1
    first = tl.minimum(split * blocks_per_split, kept)
    last = tl.minimum(first + blocks_per_split, kept)
    row_max, row_sum, acc = _attend_kept(
        q_tile, k_cache, v_cache, None, None, pt_row, indices, index_row, first * SUB_N, last * SUB_N, kv_head, 0,
        row_max, row_sum, acc, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        HEAD_DIM, BLOCK, PAGE_SIZE, False, BLOCK_N, False,
    )  # fmt: skip
    if split == 0:
        row_max, row_sum, acc = _attend_diagonal(
            q_tile, q_pos, pos, last_row, k_len, k_cache, v_cache, None, None, pt_row, kv_head, 0,
            row_max, row_sum, acc, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            HEAD_DIM, BLOCK, PAGE_SIZE, BLOCK_N, False,
        )  # fmt: skip
    # part_*: (splits, num_long_rows * BLOCK, num_heads[, HEAD_DIM]), contiguous.
    rows = ((split * num_long_rows + r) * BLOCK + sub * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64) * num_heads + head
    tl.store(part_max + rows, row_max)
    tl.store(part_sum + rows, row_sum)
    tl.store(part_acc + rows[:, None] * HEAD_DIM + dims[None, :], acc)


@jit_per_batch("cu_seqlens_q", "seqlens_k", "stride_lh", "num_long_rows", "num_splits")
def _merge_splits_kernel(
    part_acc,
    part_max,
    part_sum,
    long_rows,
    qblock_seq,
    qblock_pos,
    cu_seqlens_q,
    seqlens_k,
    out,
    lse,
    stride_ot,
    stride_oh,
    stride_lh,
    num_long_rows,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Combine the split-KV partial results of one tile of a long row into out and natural-log lse."""
    SUB_M: tl.constexpr = BLOCK // BLOCK_M
    num_heads = tl.num_programs(0) // (num_long_rows * SUB_M)
    head = tl.program_id(0) % num_heads
    tile = tl.program_id(0) // num_heads
    r = tile // SUB_M
    sub = tile % SUB_M
    qb = tl.load(long_rows + r)
    seq, pos, k_len, prefix, q_pos, q_valid, q_rows, _ = _query_tile(
        qblock_seq, qblock_pos, cu_seqlens_q, seqlens_k, qb, sub, BLOCK, BLOCK_M
    )
    dims = tl.arange(0, HEAD_DIM)
    # Split 0 holds the diagonal, so its maximum is finite on every row that belongs to the step.
    rows = ((r * BLOCK + sub * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)) * num_heads + head
    row_max = tl.load(part_max + rows)
    row_sum = tl.load(part_sum + rows)
    acc = tl.load(part_acc + rows[:, None] * HEAD_DIM + dims[None, :])
    stride_split = num_long_rows * BLOCK * num_heads
    for split in range(1, num_splits):
        split_rows = rows + split * stride_split
        split_max = tl.load(part_max + split_rows)
        new_max = tl.maximum(row_max, split_max)
        keep = tl.exp2(row_max - new_max)
        add = tl.exp2(split_max - new_max)
        row_sum = row_sum * keep + tl.load(part_sum + split_rows) * add
        acc = acc * keep[:, None] + tl.load(part_acc + split_rows[:, None] * HEAD_DIM + dims[None, :]) * add[:, None]
        row_max = new_max
    acc = acc / row_sum[:, None]
    tl.store(out + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :], acc.to(out.dtype.element_ty), mask=q_valid[:, None])
    tl.store(lse + head * stride_lh + q_rows, (row_max + tl.log2(row_sum)) / 1.4426950408889634, mask=q_valid)


def block_sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    layout: BatchLayout,
    index: BlockIndex | None,
    scale: float,
    mean_correction: bool,
    out: torch.Tensor | None,
    tile: triton.Config | None = None,
    split_kv: bool = True,
    kv_reads: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the kept blocks of ``index`` (every causal block when it is None).

    ``kv_reads``: "tma" brings K/V tiles with bulk tensor copies (Hopper and later), from the cache
    itself when its pages hold whole key tiles, else from a staged copy (stage_kv); "pointer"
    gathers every row through the page table; "auto" takes TMA where the GPU has it (see kv_read_mode).
    ``tile`` runs one tile shape instead of the autotuned choice and ``split_kv=False`` leaves long
    dense rows to one program each: both for benchmarks that compare variants."""
    total_q, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(num_heads, total_q, dtype=torch.float32, device=q.device)
    if layout.total_q_blocks == 0:
        return out, lse
    dense = index is None
    placeholder = torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device)
    counts = indices = keep_mask = placeholder
    pooled_k = pooled_v = placeholder.float().unsqueeze(0)
    if not dense:
        counts, indices = index.counts.contiguous(), index.indices.contiguous()
        if mean_correction:
            keep_mask = index.to_mask().to(torch.int8)  # same shape, so same strides, as indices
            pooled_k = pool_blocks(k_cache, page_table, seqlens_k, layout)[0]
            pooled_v = pool_blocks(v_cache, page_table, seqlens_k, layout)[0]
    long_rows = None if dense or not split_kv else launch.long_rows_to_split(layout, num_heads, q.device)
    split_flags = placeholder if long_rows is None else layout.long_row_flags
    kernel, tile_args = _attention_kernel, {}
    if tile is not None:
        kernel = _attention_kernel.fn
        tile_args = dict(tile.kwargs, num_warps=tile.num_warps, num_stages=tile.num_stages)
    group = num_heads // num_kv

    def attend(keys, values, table, descriptors, kv_heads: range) -> None:
        if tile is not None and descriptors[0] is not None:
            launch.set_descriptor_blocks(dict(zip(("k_desc", "v_desc"), descriptors), HEAD_DIM=head_dim, **tile.kwargs))
        programs = layout.total_q_blocks * len(kv_heads) * group
        grid = lambda meta: (programs * (layout.block_size // meta["BLOCK_M"]),)  # noqa: E731
        kernel[grid](
            q, keys, values, *descriptors, table, cu_seqlens_q, seqlens_k, layout.qblock_seq, layout.qblock_pos,
            counts, indices, keep_mask, pooled_k, pooled_v, split_flags, out, lse,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), table.stride(0),
            out.stride(0), out.stride(1), lse.stride(0),
            indices.stride(0), indices.stride(1), counts.stride(0),
            pooled_k.stride(0), pooled_k.stride(1), pooled_k.stride(2),
            layout.total_q_blocks, kv_heads.start, scale * LOG2E, launch.size_class(programs),
            GROUP=group, HEAD_DIM=head_dim, BLOCK=layout.block_size, PAGE_SIZE=keys.shape[1],
            DENSE=dense, MEAN_CORRECTION=mean_correction and not dense, SPLIT=long_rows is not None,
            TMA=descriptors[0] is not None, **tile_args,
        )  # fmt: skip

    sparse_context = 0 if dense else max(layout.k_lens)
    mode = launch.kv_read_mode(q, k_cache, v_cache, sparse_context) if kv_reads == "auto" else kv_reads
    if mode == "pointer":
        attend(k_cache, v_cache, page_table, (None, None), range(num_kv))
    elif staging.pages_hold_tiles(k_cache) and staging.pages_hold_tiles(v_cache):
        descriptors = (staging.descriptor(k_cache), staging.descriptor(v_cache))
        attend(k_cache, v_cache, page_table, descriptors, range(num_kv))
    else:
        per_head = layout.staging.pages * layout.block_size * head_dim * k_cache.element_size() * 2
        heads_per_copy = max(1, min(num_kv, launch.STAGE_BYTES // max(per_head, 1)))
        for first in range(0, num_kv, heads_per_copy):
            kv_heads = range(first, min(first + heads_per_copy, num_kv))
            keys, values = staging.stage_kv(k_cache, v_cache, page_table, seqlens_k, layout, kv_heads)
            attend(keys, values, layout.staging.table, (staging.descriptor(keys), staging.descriptor(values)), kv_heads)
    if long_rows is not None:
        _split_long_rows(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, layout, index, long_rows, scale, out, lse)
    return out, lse


def _split_long_rows(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, layout, index, long_rows, scale,
                     out, lse) -> None:  # fmt: skip
    """Split-KV attention of the long rows: their kept blocks in up to MAX_SPLITS ranges of at least
    MIN_SPLIT_BLOCKS blocks (launch.py), one program per range, then a merge into out and lse."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    n_rows, block = long_rows.numel(), layout.block_size
    splits = max(min(launch.MAX_SPLITS, layout.long_row_blocks // launch.MIN_SPLIT_BLOCKS), 1)
    per_split = -(-layout.long_row_blocks // splits)
    part_acc = torch.empty(splits, n_rows * block, num_heads, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(splits, n_rows * block, num_heads, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    tiles = n_rows * (block // launch.SPLIT_BLOCK_M) * num_heads
    counts, indices = index.counts.contiguous(), index.indices.contiguous()
    _split_attention_kernel[(tiles, splits)](
        q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, layout.qblock_seq, layout.qblock_pos,
        counts, indices, long_rows, part_acc, part_max, part_sum,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
        indices.stride(0), indices.stride(1), counts.stride(0),
        n_rows, per_split, scale * LOG2E,
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK=block, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=launch.SPLIT_BLOCK_M, BLOCK_N=launch.SPLIT_BLOCK_N, num_warps=4, num_stages=1 if INTERPRET else 2,
    )  # fmt: skip
    _merge_splits_kernel[(tiles,)](
        part_acc, part_max, part_sum, long_rows, layout.qblock_seq, layout.qblock_pos, cu_seqlens_q, seqlens_k,
        out, lse, out.stride(0), out.stride(1), lse.stride(0), n_rows, splits,
        HEAD_DIM=head_dim, BLOCK=block, BLOCK_M=launch.SPLIT_BLOCK_M, num_warps=4,
    )  # fmt: skip
