"""Triton kernels: key-block pooling, block selection, and block-sparse FlashAttention over a paged cache.

Block geometry is described in :mod:`prefill_accel.layout`. The search kernels read K through the
page table one token row at a time, so any page size works (1 for SGLang, 16 for vLLM); the attention
kernel reads K/V tiles that way too, or with TMA bulk copies where the GPU has them (kv_read_mode).
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .config import SparsePrefillConfig
from .layout import BatchLayout, BlockIndex

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter (triton 3.6-3.8) multiplies bf16 tl.dot operands as raw integers. Products of
# bf16/fp16 values are exact in float32, so upcasting first computes what the tensor cores do.
DOT_IN_FP32 = tl.constexpr(INTERPRET)


# Split-KV of long dense rows (layout.LONG_ROW_BLOCKS): each program takes at least MIN_SPLIT_BLOCKS
# key blocks (2K keys at block 128, enough work to hide its launch and merge), at most MAX_SPLITS
# programs per row (bounds the float32 scratch: splits x rows x block x heads x head_dim).
MIN_SPLIT_BLOCKS = 16
MAX_SPLITS = 16
SPLIT_BLOCK_M = 64  # divides every supported block size
SPLIT_BLOCK_N = 64
HIDDEN_ROW_FACTOR = 2  # see split_pays
EXACT_TILE_ROWS = 128  # sampled rows (x query heads of a group) sharing one key walk of the exact estimate
EXACT_WAVES = 2  # see exact_splits
MIN_EXACT_SPLIT_BLOCKS = 8  # 1K keys at block 128: enough walk per range to pay for its share of the merge


# Tile shapes (BLOCK_M, BLOCK_N, warps, stages) of the attention kernel. Rows gathered through the
# page table (pointer reads) and rows brought by bulk tensor copies (TMA) favour different shapes: with
# TMA one warpgroup per 128 query rows was best at head_dim 128 (docs/benchmarks.md, Reading K/V with TMA).
POINTER_TILES = [
    (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 2), (64, 32, 4, 2),
    (128, 128, 4, 2),  # the best at head_dim 64 (docs/benchmarks.md, SmolLM2's shape)
    (64, 128, 4, 3),
]  # fmt: skip
TMA_TILES = [(128, 64, 4, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 4, 2), (64, 32, 4, 2)]
# Head sizes read with TMA by default: at head_dim 128 bulk copies beat per-row reads in the dense mode
# and, from 32K, in the sparse path; at head_dim 64 they lost in the sparse path; 256 was checked for
# correctness only (docs/benchmarks.md, Reading K/V with TMA).
TMA_HEAD_DIMS = (128,)
# Below this context a sparse launch reads through the page table: the staging copy and the short walks
# cost more than bulk copies save there (docs/benchmarks.md, Reading K/V with TMA).
TMA_SPARSE_MIN_KEYS = 32768
INTERPRET_TILE = (64, 64, 4, 1)  # the interpreter gets the one with fewest programs
STAGE_BYTES = 256 * 2**20  # the most K+V one launch stages for TMA reads (see stage_kv)
# PREFILL_ACCEL_KV_READS=pointer keeps every K/V read on the page-table gather, even where TMA works.
KV_READS = os.environ.get("PREFILL_ACCEL_KV_READS", "auto")
# PREFILL_ACCEL_AUTOTUNE=0 takes the first fitting tile shape of the list without timing any (quick first calls).
AUTOTUNE = os.environ.get("PREFILL_ACCEL_AUTOTUNE", "1") != "0"


def _set_descriptor_blocks(nargs) -> None:
    """Autotuning pre-hook: the TMA descriptors bring BLOCK_N rows of one head per copy."""
    for name in ("k_desc", "v_desc"):
        if nargs[name] is not None:
            nargs[name].block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]


def _attention_configs() -> list[triton.Config]:
    """Tile shapes tried for the attention kernel: both lists, pruned to the launch's read mode."""
    shapes = [INTERPRET_TILE] if INTERPRET else list(dict.fromkeys(POINTER_TILES + TMA_TILES))
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=_set_descriptor_blocks)
        for bm, bn, w, s in shapes
    ]


def _prune_configs(configs, named_args, **kwargs):
    """Keep the tiles of the launch's read mode that divide the block (and, with TMA, the page)
    and fit in shared memory for large heads."""
    block, head_dim, tma = kwargs["BLOCK"], kwargs["HEAD_DIM"], kwargs["TMA"]
    mode_tiles = set(TMA_TILES if tma else POINTER_TILES) | {INTERPRET_TILE}
    kept = [
        c
        for c in configs
        if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in mode_tiles
        and block % c.kwargs["BLOCK_M"] == 0
        and block % c.kwargs["BLOCK_N"] == 0
        and (not tma or kwargs["PAGE_SIZE"] % c.kwargs["BLOCK_N"] == 0)
        and (head_dim < 256 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64)
    ]
    if kept and not AUTOTUNE:
        return kept[:1]
    return kept or [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=1, pre_hook=_set_descriptor_blocks)]


@triton.jit
def _dot(a, b):
    if DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _kv_slots(page_table_row, pos, PAGE_SIZE: tl.constexpr, mask):
    """Page and slot of the cache rows holding token positions ``pos`` of one sequence."""
    page = tl.load(page_table_row + pos // PAGE_SIZE, mask=mask).to(tl.int64)  # masked lanes are never read through
    return page, (pos % PAGE_SIZE).to(tl.int64)


@triton.jit
def _kv_tile(cache, desc, pt_row, k_first, kv_head, kv_column, stride_p, stride_s, stride_h, valid,
             HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """The BLOCK_N cache rows of one sequence's keys (or values) from position ``k_first`` on.

    With TMA the tile lies in one page (PAGE_SIZE is a multiple of BLOCK_N) and one bulk copy
    through ``desc``, the cache viewed as (rows, heads * HEAD_DIM), brings it; rows past the
    sequence come as they lie in the page, and the caller masks them. Otherwise each row is
    gathered through the page table, rows not ``valid`` (None: all are) read as zeros."""
    if TMA:
        page = tl.load(pt_row + k_first // PAGE_SIZE)
        return desc.load([page * PAGE_SIZE + k_first % PAGE_SIZE, kv_column])
    else:
        dims = tl.arange(0, HEAD_DIM)
        page, slot = _kv_slots(pt_row, k_first + tl.arange(0, BLOCK_N), PAGE_SIZE, valid)
        rows = page * stride_p + slot * stride_s + kv_head * stride_h
        if valid is None:
            tile = tl.load(cache + rows[:, None] + dims[None, :])
        else:
            tile = tl.load(cache + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        return tile


@triton.jit
def _pool_blocks_kernel(
    cache,
    page_table,
    seqlens_k,
    means,
    maxima,
    minima,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_pt,
    stride_pb,
    stride_pj,
    stride_ph,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    MEANS: tl.constexpr,
    EXTREMES: tl.constexpr,
):
    """means[b, j, h] = mean of the cache rows of key block j of sequence b, head h (MEANS); maxima and
    minima their elementwise maximum and minimum (EXTREMES). Accumulated in float32, stored in the
    outputs' dtype."""
    j = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    k_len = tl.load(seqlens_k + b)
    start = j * BLOCK
    if start < k_len:
        dims = tl.arange(0, HEAD_DIM)
        total = tl.zeros([HEAD_DIM], dtype=tl.float32)
        high = tl.full([HEAD_DIM], float("-inf"), dtype=tl.float32)
        low = tl.full([HEAD_DIM], float("inf"), dtype=tl.float32)
        for c in range(0, BLOCK, CHUNK):
            pos = start + c + tl.arange(0, CHUNK)
            valid = pos < k_len
            page, slot = _kv_slots(page_table + b * stride_pt, pos, PAGE_SIZE, valid)
            rows = page * stride_cp + slot * stride_cs + h * stride_ch
            x = tl.load(cache + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            if MEANS:
                total += tl.sum(x, axis=0)
            if EXTREMES:
                high = tl.maximum(high, tl.max(tl.where(valid[:, None], x, float("-inf")), axis=0))
                low = tl.minimum(low, tl.min(tl.where(valid[:, None], x, float("inf")), axis=0))
        out = b * stride_pb + j * stride_pj + h * stride_ph + dims
        if MEANS:
            mean = total / tl.minimum(k_len - start, BLOCK)
            tl.store(means + out, mean.to(means.dtype.element_ty))
        if EXTREMES:
            tl.store(maxima + out, high.to(maxima.dtype.element_ty))
            tl.store(minima + out, low.to(minima.dtype.element_ty))


@triton.jit
def _pooled_logits(q_rows, q_negative, keys_seq, low_seq, j, n_causal, k_len, qk_scale, stride_pj, dims,
                   BLOCK: tl.constexpr, BOUND: tl.constexpr):  # fmt: skip
    """Scaled (log2) logits of ``q_rows`` against the pooled keys ``keys_seq`` (in q's dtype) of key blocks ``j``,
    plus the log of each block's length; -inf past the causal blocks. With BOUND, ``q_rows`` is the
    rows' positive part and the logits are the bound q+ . max_key + q- . min_key (``low_seq`` the
    minima, ``q_negative`` the rows' negative part)."""
    causal = j[:, None] < n_causal
    keys = tl.load(keys_seq + j[:, None] * stride_pj + dims[None, :], mask=causal, other=0.0)
    dots = _dot(q_rows, tl.trans(keys))
    if BOUND:
        low = tl.load(low_seq + j[:, None] * stride_pj + dims[None, :], mask=causal, other=0.0)
        dots += _dot(q_negative, tl.trans(low))
    block_len = tl.maximum(tl.minimum(k_len - j * BLOCK, BLOCK), 1).to(tl.float32)
    logits = dots * qk_scale + tl.log2(block_len)[None, :]
    return tl.where(j[None, :] < n_causal, logits, float("-inf"))


@triton.jit
def _softmax_stats(logits, row_max, row_sum):
    """Fold a tile of base-2 logits into each row's running softmax maximum and normaliser."""
    new_max = tl.maximum(row_max, tl.max(logits, axis=1))
    return new_max, row_sum * tl.exp2(row_max - new_max) + tl.sum(tl.exp2(logits - new_max[:, None]), axis=1)


@triton.jit
def _pooled_scores(q, means, maxima, minima, scores, row_stats, qb, h, seq, pos, k_len, q_start, prefix, n_causal,
                   out_row, stride_qt, stride_qh, stride_pb, stride_pj, stride_ph, qk_scale,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, STRIDE: tl.constexpr,
                   ROWS: tl.constexpr, ROW_CHUNK: tl.constexpr, BLOCK_J: tl.constexpr, MEANS: tl.constexpr,
                   BOUNDS: tl.constexpr):  # fmt: skip
    """The pooled estimate (MEANS), the bound estimate (BOUNDS) or the sum of both, of one query block
    and KV head, summed (not yet averaged) over the scored rows of every query head of the group into
    ``scores``: two passes over the pooled keys, the first for each row's softmax maximum and
    normaliser (kept in ``row_stats``), the second for the shares."""
    cols = tl.arange(0, BLOCK_J)
    dims = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, ROW_CHUNK)
    seq_offset = seq.to(tl.int64) * stride_pb + h * stride_ph
    means_seq, maxima_seq, minima_seq = means + seq_offset, maxima + seq_offset, minima + seq_offset
    stats = row_stats + (qb * tl.num_programs(1) + h).to(tl.int64) * (4 * ROW_CHUNK)
    # The scored rows of all query heads of the group, flattened (head-major) and taken
    # ROW_CHUNK at a time, so one pooled-key tile serves every head of the group.
    for c in range(0, GROUP * ROWS, ROW_CHUNK):
        flat = c + rows
        chunk_pos = pos * BLOCK + (flat % ROWS) * STRIDE + (STRIDE - 1)
        chunk_valid = (flat < GROUP * ROWS) & (chunk_pos >= prefix) & (chunk_pos < k_len)
        q_offsets = (q_start + chunk_pos - prefix).to(tl.int64) * stride_qt + (h * GROUP + flat // ROWS) * stride_qh
        q_chunk = tl.load(q + q_offsets[:, None] + dims[None, :], mask=chunk_valid[:, None], other=0.0)
        if BOUNDS:  # the rows' positive and negative parts, once per chunk
            q_positive = tl.maximum(q_chunk, 0.0).to(q_chunk.dtype)
            q_negative = (q_chunk - q_positive).to(q_chunk.dtype)
        mean_max = tl.full([ROW_CHUNK], float("-inf"), dtype=tl.float32)
        mean_sum = tl.zeros([ROW_CHUNK], dtype=tl.float32)
        bound_max = tl.full([ROW_CHUNK], float("-inf"), dtype=tl.float32)
        bound_sum = tl.zeros([ROW_CHUNK], dtype=tl.float32)
        for j0 in range(0, n_causal, BLOCK_J):
            j = j0 + cols
            if MEANS:
                logits = _pooled_logits(q_chunk, q_chunk, means_seq, means_seq, j, n_causal, k_len, qk_scale, stride_pj,
                                        dims, BLOCK, False)  # fmt: skip
                mean_max, mean_sum = _softmax_stats(logits, mean_max, mean_sum)
            if BOUNDS:
                logits = _pooled_logits(q_positive, q_negative, maxima_seq, minima_seq, j, n_causal, k_len, qk_scale,
                                        stride_pj, dims, BLOCK, True)  # fmt: skip
                bound_max, bound_sum = _softmax_stats(logits, bound_max, bound_sum)
        if MEANS:
            tl.store(stats + rows, mean_max)
            tl.store(stats + ROW_CHUNK + rows, tl.where(chunk_valid, 1.0 / mean_sum, 0.0))
        if BOUNDS:
            tl.store(stats + 2 * ROW_CHUNK + rows, bound_max)
            tl.store(stats + 3 * ROW_CHUNK + rows, tl.where(chunk_valid, 1.0 / bound_sum, 0.0))
        tl.debug_barrier()
        mean_max, mean_inv = tl.load(stats + rows), tl.load(stats + ROW_CHUNK + rows)
        bound_max, bound_inv = tl.load(stats + 2 * ROW_CHUNK + rows), tl.load(stats + 3 * ROW_CHUNK + rows)
        for j0 in range(0, n_causal, BLOCK_J):
            j = j0 + cols
            mass = tl.zeros([BLOCK_J], dtype=tl.float32)
            if MEANS:
                logits = _pooled_logits(q_chunk, q_chunk, means_seq, means_seq, j, n_causal, k_len, qk_scale, stride_pj,
                                        dims, BLOCK, False)  # fmt: skip
                mass += tl.sum(tl.exp2(logits - mean_max[:, None]) * mean_inv[:, None], axis=0)
            if BOUNDS:
                logits = _pooled_logits(q_positive, q_negative, maxima_seq, minima_seq, j, n_causal, k_len, qk_scale,
                                        stride_pj, dims, BLOCK, True)  # fmt: skip
                mass += tl.sum(tl.exp2(logits - bound_max[:, None]) * bound_inv[:, None], axis=0)
            previous = tl.load(scores + out_row + j, mask=j < n_causal, other=0.0)
            tl.store(scores + out_row + j, previous + mass, mask=j < n_causal)
        tl.debug_barrier()


@triton.jit
def _select_kernel(
    q,
    means,
    maxima,
    minima,
    cu_seqlens_q,
    seqlens_k,
    qblock_seq,
    qblock_pos,
    qblock_dense,
    row_stats,
    scores,
    counts,
    indices,
    stride_qt,
    stride_qh,
    stride_pb,
    stride_pj,
    stride_ph,
    stride_sr,
    stride_sh,
    qk_scale,
    threshold,
    target_mass,
    sink_blocks,
    local_blocks,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    STRIDE: tl.constexpr,
    ROWS: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    BLOCK_J: tl.constexpr,
    PRESCORED: tl.constexpr,
    MEANS: tl.constexpr,
    BOUNDS: tl.constexpr,
    MASS_BISECTION_STEPS: tl.constexpr = 24,  # resolves the cut to max / 2**24, below fp32 rounding of a share
):
    """One query block, one KV head: estimate each causal key block's share of attention, keep the
    blocks at or above ``threshold`` x the largest share, and with ``target_mass`` > 0 also the
    highest-share blocks that together hold ``target_mass`` (plus sink, local and diagonal blocks),
    and write their indices in ascending order. No sort: a pass finds the maximum, a bisection
    finds the mass cut, a pass compacts.

    The pooled estimate for block j averages, over the scored query rows of the block and the query
    heads of the group, softmax_j(scale * q . mean_key_j + ln n_j) (MEANS); the bound estimate has
    q+ . max_key_j + q- . min_key_j (``maxima``, ``minima``) for q . mean_key_j (BOUNDS); with both,
    the estimate is their mean. ``row_stats`` is scratch holding each row's softmax maxima and
    normalisers between the two passes over the pooled keys. With PRESCORED the shares are already in
    ``scores`` (the exact estimate) and only the cut runs.
    """
    qb = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(qblock_seq + qb)
    pos = tl.load(qblock_pos + qb)
    k_len = tl.load(seqlens_k + seq)
    q_start = tl.load(cu_seqlens_q + seq)
    prefix = k_len - (tl.load(cu_seqlens_q + seq + 1) - q_start)
    n_causal = pos + 1
    out_row = qb.to(tl.int64) * stride_sr + h * stride_sh

    row_pos = pos * BLOCK + tl.arange(0, ROWS) * STRIDE + (STRIDE - 1)
    row_valid = (row_pos >= prefix) & (row_pos < k_len)
    n_rows = tl.sum(row_valid.to(tl.int32), axis=0)
    dense = tl.load(qblock_dense + qb) != 0
    if not PRESCORED:
        dense |= n_rows == 0
    cols = tl.arange(0, BLOCK_J)

    if dense:
        for j0 in range(0, n_causal, BLOCK_J):
            tl.store(indices + out_row + j0 + cols, j0 + cols, mask=j0 + cols < n_causal)
        tl.store(counts + qb * tl.num_programs(1) + h, n_causal)
    else:
        norm = 1.0
        if not PRESCORED:
            _pooled_scores(q, means, maxima, minima, scores, row_stats, qb, h, seq, pos, k_len, q_start, prefix,
                           n_causal, out_row, stride_qt, stride_qh, stride_pb, stride_pj, stride_ph, qk_scale,
                           GROUP, HEAD_DIM, BLOCK, STRIDE, ROWS, ROW_CHUNK, BLOCK_J, MEANS, BOUNDS)  # fmt: skip
            norm = 1.0 / (n_rows * GROUP).to(tl.float32)
            if MEANS and BOUNDS:  # the mean of the two estimates
                norm = norm * 0.5
        best = tl.zeros([BLOCK_J], dtype=tl.float32)
        for j0 in range(0, n_causal, BLOCK_J):
            j = j0 + cols
            mass = tl.load(scores + out_row + j, mask=j < n_causal, other=0.0) * norm
            if not PRESCORED:
                tl.store(scores + out_row + j, mass, mask=j < n_causal)
            best = tl.maximum(best, mass)
        tl.debug_barrier()
        cut = threshold * tl.max(best, axis=0)
        if target_mass > 0:
            # The mass-targeted cut: the largest value whose blocks at or above it hold target_mass
            # of the estimate, found by bisection over [0, max] instead of a sort.
            low = 0.0
            high = tl.max(best, axis=0)
            for _ in range(MASS_BISECTION_STEPS):
                mid = (low + high) * 0.5
                held = tl.zeros([BLOCK_J], dtype=tl.float32)
                for j0 in range(0, n_causal, BLOCK_J):
                    j = j0 + cols
                    mass = tl.load(scores + out_row + j, mask=j < n_causal, other=0.0)
                    held += tl.where(mass >= mid, mass, 0.0)
                reached = tl.sum(held, axis=0) >= target_mass
                low = tl.where(reached, mid, low)
                high = tl.where(reached, high, mid)
            cut = tl.minimum(cut, low)
        kept = 0
        for j0 in range(0, n_causal, BLOCK_J):
            j = j0 + cols
            mass = tl.load(scores + out_row + j, mask=j < n_causal, other=0.0)
            keep = (j < n_causal) & ((mass >= cut) | (j < sink_blocks) | (j >= pos - local_blocks))
            flags = keep.to(tl.int32)
            slot = kept + tl.cumsum(flags, axis=0) - flags
            tl.store(indices + out_row + slot, j, mask=keep)
            kept += tl.sum(flags, axis=0)
        tl.store(counts + qb * tl.num_programs(1) + h, kept)


@triton.jit
def _exact_rows(qblock_seq, qblock_pos, qblock_dense, cu_seqlens_q, seqlens_k, tile, h, total_q_blocks, stride_qt,
                stride_qh, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, ROWS: tl.constexpr, QB_TILE: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    """The sampled rows of query-block tile ``tile`` for KV head ``h``, flattened as (query block,
    sample, query head of the group padded to GROUP_P2): each row's sequence, absolute position,
    whether it is scored, and its offset into q. ROWS evenly spaced rows per block end at the
    block's last row; a row past the sequence's end moves to its last position, once."""
    PER_BLOCK: tl.constexpr = ROWS * GROUP_P2
    STRIDE: tl.constexpr = BLOCK // ROWS
    r = tl.arange(0, QB_TILE * PER_BLOCK)
    qb = tile * QB_TILE + r // PER_BLOCK
    sample = (r // GROUP_P2) % ROWS
    head = r % GROUP_P2
    in_range = qb < total_q_blocks
    qb = tl.minimum(qb, total_q_blocks - 1)
    seq = tl.load(qblock_seq + qb)
    pos = tl.load(qblock_pos + qb)
    k_len = tl.load(seqlens_k + seq)
    q_start = tl.load(cu_seqlens_q + seq)
    prefix = k_len - (tl.load(cu_seqlens_q + seq + 1) - q_start)
    unclipped = pos * BLOCK + (sample + 1) * STRIDE - 1
    row_pos = tl.minimum(unclipped, k_len - 1)
    scored = in_range & (tl.load(qblock_dense + qb) == 0) & (head < GROUP)
    scored &= ((sample == 0) | (unclipped - STRIDE < k_len - 1)) & (row_pos >= prefix)
    q_offsets = (q_start + row_pos - prefix).to(tl.int64) * stride_qt + (h * GROUP + head) * stride_qh
    return seq, row_pos, scored, q_offsets


@triton.jit
def _exact_logits(q_rows, k_cache, table, key_pos, row_pos, mine, key_end, h, stride_kp, stride_ks, stride_kh,
                  qk_scale, PAGE_SIZE: tl.constexpr, dims):  # fmt: skip
    """Scaled (log2) logits of the sampled rows against the keys at ``key_pos`` (those below
    ``key_end`` are read), -inf where causality or the row mask forbids."""
    key_valid = key_pos < key_end
    page, slot = _kv_slots(table, key_pos, PAGE_SIZE, key_valid)
    rows = page * stride_kp + slot * stride_ks + h * stride_kh
    keys = tl.load(k_cache + rows[:, None] + dims[None, :], mask=key_valid[:, None], other=0.0)
    logits = _dot(q_rows, tl.trans(keys)) * qk_scale
    allowed = mine[:, None] & (key_pos[None, :] <= row_pos[:, None]) & key_valid[None, :]
    return tl.where(allowed, logits, float("-inf"))


@triton.jit
def _exact_kernel(
    q,
    k_cache,
    page_table,
    cu_seqlens_q,
    seqlens_k,
    qblock_seq,
    qblock_pos,
    qblock_dense,
    part_max,
    part_sum,
    scores,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_pt,
    stride_sr,
    stride_sh,
    total_q_blocks,
    split_blocks,
    qk_scale,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    ROWS: tl.constexpr,
    QB_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SHARES: tl.constexpr,
):
    """The exact estimate of QB_TILE consecutive query blocks, one KV head, one range of
    ``split_blocks`` key blocks (program axis 2): the sampled rows of every query head of the group
    attend exactly over their causal keys. The first launch (SHARES False) stores each row's softmax
    maximum and normaliser over the range in part_max / part_sum; the second merges those of every
    range and writes, for each key block of its range, the mean over the block's rows of their
    attention mass on it into scores[qb, h, j].

    The rows of a tile share every key tile it reads through the page table. A tile spanning several
    sequences walks each sequence's keys in turn with the other rows masked.
    """
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    PER_BLOCK: tl.constexpr = ROWS * GROUP_P2
    R: tl.constexpr = QB_TILE * PER_BLOCK
    seq, row_pos, scored, q_offsets = _exact_rows(
        qblock_seq, qblock_pos, qblock_dense, cu_seqlens_q, seqlens_k, tile, h, total_q_blocks, stride_qt, stride_qh,
        GROUP, GROUP_P2, ROWS, QB_TILE, BLOCK,
    )  # fmt: skip
    dims = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)
    stats = (split * tl.num_programs(0) * tl.num_programs(1) + tile * tl.num_programs(1) + h).to(tl.int64) * R
    stats_step = tl.num_programs(0) * tl.num_programs(1) * R
    tile_qb = tile * QB_TILE + tl.arange(0, QB_TILE)
    tile_pos = tl.load(qblock_pos + tl.minimum(tile_qb, total_q_blocks - 1))
    first_seq = tl.load(qblock_seq + tile * QB_TILE)
    last_seq = tl.load(qblock_seq + tl.minimum(tile * QB_TILE + QB_TILE, total_q_blocks) - 1)
    key_start = split * split_blocks * BLOCK
    row_max = tl.full([R], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([R], dtype=tl.float32)
    for s in range(first_seq, last_seq + 1):
        mine = scored & (seq == s)
        last_row = tl.max(tl.where(mine, row_pos, -1), axis=0)
        key_end = tl.minimum(key_start + split_blocks * BLOCK, last_row + 1)
        if key_start < key_end:
            table = page_table + s * stride_pt
            q_rows = tl.load(q + q_offsets[:, None] + dims[None, :], mask=mine[:, None], other=0.0)
            if not SHARES:
                for n0 in range(key_start, key_end, BLOCK_N):
                    logits = _exact_logits(q_rows, k_cache, table, n0 + cols, row_pos, mine, key_end, h,
                                           stride_kp, stride_ks, stride_kh, qk_scale, PAGE_SIZE, dims)  # fmt: skip
                    new_max = tl.maximum(row_max, tl.max(logits, axis=1))
                    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
                    row_sum = row_sum * tl.exp2(row_max - safe_max) + tl.sum(tl.exp2(logits - safe_max[:, None]), axis=1)
                    row_max = new_max
            else:
                # Merge the ranges' statistics: every row's maximum and normaliser over all its keys.
                for other in range(0, tl.num_programs(2)):
                    offsets = stats + (other - split) * stats_step + tl.arange(0, R)
                    other_max = tl.load(part_max + offsets)
                    new_max = tl.maximum(row_max, other_max)
                    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
                    row_sum = row_sum * tl.exp2(row_max - safe_max) + tl.load(part_sum + offsets) * tl.exp2(other_max - safe_max)
                    row_max = new_max
                # Each row weighs 1 / (its normaliser x the scored rows of its query block).
                row_weight = tl.where(mine, 1.0 / tl.where(mine, row_sum, 1.0), 0.0)
                rows_of_block = tl.sum(tl.reshape(mine.to(tl.float32), (QB_TILE, PER_BLOCK)), axis=1)
                block_weight = tl.where(rows_of_block > 0, 1.0 / tl.maximum(rows_of_block, 1.0), 0.0)
                safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
                out_rows = tile_qb.to(tl.int64) * stride_sr + h * stride_sh
                for j in range(key_start // BLOCK, (key_end - 1) // BLOCK + 1):
                    mass = tl.zeros([R], dtype=tl.float32)
                    for sub in tl.static_range(0, BLOCK, BLOCK_N):
                        logits = _exact_logits(q_rows, k_cache, table, j * BLOCK + sub + cols, row_pos, mine, key_end,
                                               h, stride_kp, stride_ks, stride_kh, qk_scale, PAGE_SIZE, dims)  # fmt: skip
                        mass += tl.sum(tl.exp2(logits - safe_max[:, None]), axis=1)
                    share = tl.sum(tl.reshape(mass * row_weight, (QB_TILE, PER_BLOCK)), axis=1) * block_weight
                    tl.store(scores + out_rows + j, share, mask=(block_weight > 0) & (j <= tile_pos))
                row_max = tl.full([R], float("-inf"), dtype=tl.float32)
                row_sum = tl.zeros([R], dtype=tl.float32)
    if not SHARES:
        tl.store(part_max + stats + tl.arange(0, R), row_max)
        tl.store(part_sum + stats + tl.arange(0, R), row_sum)


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
        keys = _kv_tile(k_cache, k_desc, pt_row, k_first, kv_head, kv_column, stride_kp, stride_ks, stride_kh, None,
                        HEAD_DIM, PAGE_SIZE, BLOCK_N, TMA)  # fmt: skip
        scores = _dot(q_tile, tl.trans(keys))  # unscaled: the scale folds into the exponent's FMA below
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * qk_scale)
        probs = tl.exp2(scores * qk_scale - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None]
        values = _kv_tile(v_cache, v_desc, pt_row, k_first, kv_head, kv_column, stride_vp, stride_vs, stride_vh, None,
                          HEAD_DIM, PAGE_SIZE, BLOCK_N, TMA)  # fmt: skip
        acc += _dot(probs.to(values.dtype), values)
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
    acc += _dot(probs.to(values.dtype), values)
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
        keys = _kv_tile(k_cache, k_desc, pt_row, k_first, kv_head, kv_column, stride_kp, stride_ks, stride_kh, k_valid,
                        HEAD_DIM, PAGE_SIZE, BLOCK_N, TMA)  # fmt: skip
        logits = _dot(q_tile, tl.trans(keys)) * qk_scale
        logits = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :], logits, float("-inf"))
        values = _kv_tile(v_cache, v_desc, pt_row, k_first, kv_head, kv_column, stride_vp, stride_vs, stride_vh, k_valid,
                          HEAD_DIM, PAGE_SIZE, BLOCK_N, TMA)  # fmt: skip
        if TMA:  # rows past the sequence hold whatever the page holds: keep them out of 0 * value
            values = tl.where(k_valid[:, None], values, 0.0)
        row_max, row_sum, acc = _online_softmax_step(logits, values, row_max, row_sum, acc)
    return row_max, row_sum, acc


def _size_class(programs: int) -> int:
    """Autotuning bucket of a launch by its query tiles x heads (at BLOCK 128): the best tile shape
    for a few hundred programs is not the best for many waves of them, so each class tunes once."""
    return 0 if programs < 2048 else 1 if programs < 8192 else 2


@triton.autotune(
    configs=_attention_configs(),
    key=["HEAD_DIM", "BLOCK", "PAGE_SIZE", "DENSE", "GROUP", "TMA", "size_class"],
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit
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
                logits = _dot(q_tile, tl.trans(mean_k.to(q_tile.dtype))) * qk_scale + math.log2(BLOCK)
                logits = tl.where(pruned[None, :], logits, float("-inf"))
                mean_v = tl.load(pooled_v + pooled_row + j[:, None] * stride_pj + dims[None, :], mask=pruned[:, None], other=0.0)
                row_max, row_sum, acc = _online_softmax_step(logits, mean_v, row_max, row_sum, acc)

        acc = acc / row_sum[:, None]
        tl.store(out + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :], acc.to(out.dtype.element_ty), mask=q_valid[:, None])
        tl.store(lse + head * stride_lh + q_rows, (row_max + tl.log2(row_sum)) / 1.4426950408889634, mask=q_valid)


@triton.jit
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


@triton.jit
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


@triton.jit
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
        page, slot = _kv_slots(pt_row, tl.minimum(first + rows, last), PAGE_SIZE, None)
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


@triton.jit
def _gather_kernel(
    k_cache, v_cache, page_table_row, k_out, v_out, length, stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh, stride_oh, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Copy positions [ROWS * program_id(0), + ROWS) of one sequence's keys and values of KV head
    ``program_id(1)`` out of the pages into row-major (heads, length, HEAD_DIM) tensors. Loads its own
    tiles rather than through _kv_tile: masked rows need no fill value here, and it ran faster so
    (docs/benchmarks.md, One launch for the gather)."""
    head = tl.program_id(1)
    pos = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = pos < length
    page, slot = _kv_slots(page_table_row, pos, PAGE_SIZE, valid)
    dims = tl.arange(0, HEAD_DIM)
    gathered = (head.to(tl.int64) * stride_oh + pos.to(tl.int64) * HEAD_DIM)[:, None] + dims[None, :]
    keys = tl.load(k_cache + (page * stride_kp + slot * stride_ks + head * stride_kh)[:, None] + dims[None, :], mask=valid[:, None])
    tl.store(k_out + gathered, keys, mask=valid[:, None])
    values = tl.load(v_cache + (page * stride_vp + slot * stride_vs + head * stride_vh)[:, None] + dims[None, :], mask=valid[:, None])
    tl.store(v_out + gathered, values, mask=valid[:, None])


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, seq: int, length: int):
    """The first ``length`` keys and values of sequence ``seq``, one launch for both: each a (length,
    num_kv_heads, head_dim) view of row-major (num_kv_heads, length, head_dim) storage, the layout
    cuDNN attention reads at least as fast as any other (H200, scripts/experiments/dense_route_8k.py)."""
    num_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_out = torch.empty(num_kv, length, head_dim, dtype=k_cache.dtype, device=k_cache.device)
    v_out = torch.empty_like(k_out)
    rows = 8192 // head_dim  # a 16 KB tile at 16 bits
    if length:
        _gather_kernel[(triton.cdiv(length, rows), num_kv)](
            k_cache, v_cache, page_table[seq], k_out, v_out, length, k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_out.stride(0),
            PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, ROWS=rows,
        )  # fmt: skip
    return k_out.transpose(0, 1), v_out.transpose(0, 1)


def pool_blocks(cache: torch.Tensor, page_table: torch.Tensor, seqlens_k: torch.Tensor, layout: BatchLayout,
                means: bool = True, extremes: bool = False, dtype: torch.dtype = torch.float32):  # fmt: skip
    """(means, maxima, minima) of every key (or value) block, each (batch, max_k_blocks, num_kv_heads,
    head_dim) in ``dtype``, from one pass over the cache: the block's mean with ``means``, its elementwise
    maximum and minimum with ``extremes``; None for what was not asked. Blocks past a sequence's length
    are left unwritten: no kernel reads them (a query block sees only key blocks up to its own)."""
    head_dim, num_kv = cache.shape[3], cache.shape[2]
    shape = (layout.batch, max(layout.max_k_blocks, 1), num_kv, head_dim)
    outputs = [torch.empty(shape, dtype=dtype, device=cache.device) if wanted else None
               for wanted in (means, extremes, extremes)]  # fmt: skip
    first = next(x for x in outputs if x is not None)
    if layout.max_k_blocks:
        _pool_blocks_kernel[(layout.max_k_blocks, layout.batch, num_kv)](
            cache, page_table, seqlens_k, *(first if x is None else x for x in outputs),
            cache.stride(0), cache.stride(1), cache.stride(2), page_table.stride(0),
            first.stride(0), first.stride(1), first.stride(2),
            PAGE_SIZE=cache.shape[1], BLOCK=layout.block_size, HEAD_DIM=head_dim, CHUNK=min(layout.block_size, 64),
            MEANS=means, EXTREMES=extremes,
        )  # fmt: skip
    return tuple(outputs)


def select_blocks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    layout: BatchLayout,
    config: SparsePrefillConfig,
    scale: float,
    launch: dict | None = None,
) -> BlockIndex:
    """Run the block search on validated, kernel-supported inputs (see :func:`prefill_accel.select_blocks`).
    ``launch`` overrides the search kernel's key tile and launch options (BLOCK_J, num_warps, num_stages),
    for timing them."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    total_qb, n_blocks = layout.total_q_blocks, max(layout.max_k_blocks, 1)
    counts = torch.empty(total_qb, num_kv, dtype=torch.int32, device=q.device)
    indices = torch.empty(total_qb, num_kv, n_blocks, dtype=torch.int32, device=q.device)
    scores = torch.zeros(total_qb, num_kv, n_blocks, dtype=torch.float32, device=q.device)
    if total_qb == 0:
        return BlockIndex(layout=layout, counts=counts, indices=indices, scores=scores)
    group = num_heads // num_kv
    rows = config.block_size // config.query_stride
    exact = config.estimator == "exact"
    with_means = config.estimator in ("pooled", "mixed")
    with_bounds = config.estimator in ("bound", "mixed")
    # Launch shapes as timed (docs/benchmarks.md, The three searches, and the search's launch): 4 warps up
    # to head_dim 128, key tiles of 32 blocks for the bound search; at head_dim 256, 8 warps and tiles of 32.
    # Searches with more than 256 operand values per key block run unpipelined, as timed (with fp32
    # operands, the pipelined bound search at head_dim 256 asked for 288 KB of shared memory), and
    # bound searches at head_dim 256 take half the rows.
    # At least 16 rows: the smallest tile tl.dot multiplies (the padding rows are masked).
    row_chunk = max(16, min(64 if with_bounds and head_dim > 128 else 128, triton.next_power_of_2(group * rows)))
    options = dict(BLOCK_J=64, num_warps=4)
    if head_dim > 128 or (with_bounds and not with_means):
        options["BLOCK_J"] = 32
    if head_dim > 128 and not INTERPRET:
        options["num_warps"] = 8
    if head_dim * (with_means + 2 * with_bounds) > 256:
        options["num_stages"] = 1
    means = maxima = minima = row_stats = scores  # the pooled scoring's inputs a launch does not read
    if exact:
        _exact_scores(q, k_cache, page_table, cu_seqlens_q, seqlens_k, layout, config, scale, scores)
    else:
        # In q's dtype: the search multiplies them in it, so they are rounded to it once, here.
        blocks = pool_blocks(k_cache, page_table, seqlens_k, layout, with_means, with_bounds, q.dtype)
        means, maxima, minima = (scores if x is None else x for x in blocks)
        row_stats = torch.empty(total_qb, num_kv, 4 * row_chunk, dtype=torch.float32, device=q.device)
    pooled = means if with_means else maxima  # all pooled tensors share one layout
    _select_kernel[(total_qb, num_kv)](
        q, means, maxima, minima, cu_seqlens_q, seqlens_k, layout.qblock_seq, layout.qblock_pos, layout.qblock_dense,
        row_stats, scores, counts, indices,
        q.stride(0), q.stride(1), pooled.stride(0), pooled.stride(1), pooled.stride(2),
        scores.stride(0), scores.stride(1),
        scale * LOG2E, config.threshold, config.target_mass, config.sink_blocks, config.local_blocks,
        GROUP=group, HEAD_DIM=head_dim, BLOCK=config.block_size, STRIDE=config.query_stride,
        ROWS=rows, ROW_CHUNK=row_chunk, PRESCORED=exact, MEANS=with_means, BOUNDS=with_bounds,
        **(options | (launch or {})),
    )  # fmt: skip
    return BlockIndex(layout=layout, counts=counts, indices=indices, scores=scores)


def exact_splits(layout: BatchLayout, programs: int, sms: int) -> int:
    """Key ranges each (tile, KV head) of the exact estimate is split into: enough programs for
    EXACT_WAVES waves on ``sms`` multiprocessors, each range at least MIN_EXACT_SPLIT_BLOCKS key
    blocks. A fresh long prompt has tiles enough; a chunk after a long prefix has few tiles, each
    walking the whole context, and needs the split."""
    longest = max(layout.max_k_blocks, 1)
    wanted = -(-EXACT_WAVES * sms // max(programs, 1))
    return max(1, min(wanted, longest // MIN_EXACT_SPLIT_BLOCKS))


def _exact_scores(q, k_cache, page_table, cu_seqlens_q, seqlens_k, layout, config, scale, scores) -> None:
    """Fill ``scores`` with the exact estimate (see _exact_kernel): tiles of query blocks whose
    sampled rows make about EXACT_TILE_ROWS rows, one program per tile, KV head and key range."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    group_p2 = triton.next_power_of_2(group)
    qb_tile = max(EXACT_TILE_ROWS // (config.exact_rows * group_p2), 1)
    tiles = triton.cdiv(layout.total_q_blocks, qb_tile)
    # Off the GPU (the interpreter) a small machine, so that tests of a few dozen blocks split the keys too.
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda" else 8
    splits = exact_splits(layout, tiles * num_kv, sms)
    split_blocks = -(-max(layout.max_k_blocks, 1) // splits)
    rows = qb_tile * config.exact_rows * group_p2
    part_max = torch.empty(splits, tiles, num_kv, rows, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    for shares in (False, True):
        _exact_kernel[(tiles, num_kv, splits)](
            q, k_cache, page_table, cu_seqlens_q, seqlens_k, layout.qblock_seq, layout.qblock_pos, layout.qblock_dense,
            part_max, part_sum, scores, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), page_table.stride(0), scores.stride(0), scores.stride(1), layout.total_q_blocks,
            split_blocks, scale * LOG2E,
            GROUP=group, GROUP_P2=group_p2, ROWS=config.exact_rows, QB_TILE=qb_tile, HEAD_DIM=head_dim,
            BLOCK=layout.block_size, PAGE_SIZE=k_cache.shape[1], BLOCK_N=64 if head_dim <= 128 else 32,
            SHARES=shares, num_warps=4 if INTERPRET else 8, num_stages=1 if INTERPRET else 2,
        )  # fmt: skip


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
    long_rows = None if dense or not split_kv else _long_rows_to_split(layout, num_heads, q.device)
    split_flags = placeholder if long_rows is None else layout.long_row_flags
    kernel, tile_args = _attention_kernel, {}
    if tile is not None:
        kernel = _attention_kernel.fn
        tile_args = dict(tile.kwargs, num_warps=tile.num_warps, num_stages=tile.num_stages)
    group = num_heads // num_kv

    def launch(keys, values, table, descriptors, kv_heads: range) -> None:
        if tile is not None and descriptors[0] is not None:
            _set_descriptor_blocks(dict(zip(("k_desc", "v_desc"), descriptors), HEAD_DIM=head_dim, **tile.kwargs))
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
            layout.total_q_blocks, kv_heads.start, scale * LOG2E, _size_class(programs),
            GROUP=group, HEAD_DIM=head_dim, BLOCK=layout.block_size, PAGE_SIZE=keys.shape[1],
            DENSE=dense, MEAN_CORRECTION=mean_correction and not dense, SPLIT=long_rows is not None,
            TMA=descriptors[0] is not None, **tile_args,
        )  # fmt: skip

    sparse_context = 0 if dense else max(layout.k_lens)
    mode = kv_read_mode(q, k_cache, v_cache, sparse_context) if kv_reads == "auto" else kv_reads
    if mode == "pointer":
        launch(k_cache, v_cache, page_table, (None, None), range(num_kv))
    elif _pages_hold_tiles(k_cache) and _pages_hold_tiles(v_cache):
        launch(k_cache, v_cache, page_table, (_descriptor(k_cache), _descriptor(v_cache)), range(num_kv))
    else:
        per_head = layout.staging.pages * layout.block_size * head_dim * k_cache.element_size() * 2
        heads_per_copy = max(1, min(num_kv, STAGE_BYTES // max(per_head, 1)))
        for first in range(0, num_kv, heads_per_copy):
            kv_heads = range(first, min(first + heads_per_copy, num_kv))
            keys, values = stage_kv(k_cache, v_cache, page_table, seqlens_k, layout, kv_heads)
            launch(keys, values, layout.staging.table, (_descriptor(keys), _descriptor(values)), kv_heads)
    if long_rows is not None:
        _split_long_rows(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, layout, index, long_rows, scale, out, lse)
    return out, lse


def kv_read_mode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sparse_context: int = 0) -> str:
    """"tma" for 16-bit caches at a head size in TMA_HEAD_DIMS on CUDA GPUs with bulk tensor copies
    (compute capability 9.0 and later), in dense mode or for a sparse launch whose longest sequence
    (``sparse_context``; 0 in dense mode) has TMA_SPARSE_MIN_KEYS keys; else "pointer".
    PREFILL_ACCEL_KV_READS=pointer (or tma) decides instead; tma where the GPU has no bulk tensor
    copies reads through the page table, with one warning."""
    capable = q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9
    if KV_READS == "tma" and not (capable or INTERPRET):
        _warn_once("PREFILL_ACCEL_KV_READS=tma needs compute capability 9.0 or later: reading K/V through the page table")
        return "pointer"
    if KV_READS in ("pointer", "tma"):
        return KV_READS
    sixteen_bit = k_cache.dtype in (torch.float16, torch.bfloat16) and v_cache.dtype == k_cache.dtype
    long_enough = sparse_context == 0 or sparse_context >= TMA_SPARSE_MIN_KEYS
    return "tma" if capable and sixteen_bit and q.shape[2] in TMA_HEAD_DIMS and long_enough else "pointer"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _pages_hold_tiles(cache: torch.Tensor) -> bool:
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


def _descriptor(cache: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over a (pages, page_size, heads, head_dim) cache seen as (rows, heads * head_dim);
    the kernel (or its autotuning pre-hook) sets the block shape."""
    pages, page_size, heads, head_dim = cache.shape
    return TensorDescriptor(cache, [pages * page_size, heads * head_dim], [cache.stride(1), 1], [64, head_dim])


def _long_rows_to_split(layout: BatchLayout, num_heads: int, device: torch.device) -> torch.Tensor | None:
    """The layout's long dense rows when splitting them pays (always on the interpreter), else None."""
    if layout.long_rows.numel() == 0:
        return None
    if device.type != "cuda":
        return layout.long_rows
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return layout.long_rows if split_pays(layout, num_heads, sms) else None


def split_pays(layout: BatchLayout, num_heads: int, sms: int) -> bool:
    """Whether split-KV of the layout's long rows beats one program per row on ``sms`` multiprocessors.

    It pays while the long rows alone would not fill the multiprocessors and their walk outlasts
    the other query blocks' work. That work is not known before the search; each of them keeps at
    least its sink, local and diagonal blocks, and when HIDDEN_ROW_FACTOR times that floor, per
    multiprocessor, covers the longest walk, the rows (which start first) finish in its shadow and
    a split only adds a launch and a merge (the measurements: docs/benchmarks.md, Split-KV of long
    dense rows).
    """
    n = layout.long_rows.numel()
    if n == 0 or n * num_heads >= sms:
        return False
    config = layout.config
    floor = (layout.total_q_blocks - n) * (config.sink_blocks + config.local_blocks + 1) * num_heads / sms
    return layout.long_row_blocks > HIDDEN_ROW_FACTOR * floor


def _split_long_rows(q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, layout, index, long_rows, scale,
                     out, lse) -> None:  # fmt: skip
    """Split-KV attention of the long rows: their kept blocks in up to MAX_SPLITS ranges of at least
    MIN_SPLIT_BLOCKS blocks, one program per range, then a merge into out and lse."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    n_rows, block = long_rows.numel(), layout.block_size
    splits = max(min(MAX_SPLITS, layout.long_row_blocks // MIN_SPLIT_BLOCKS), 1)
    per_split = -(-layout.long_row_blocks // splits)
    part_acc = torch.empty(splits, n_rows * block, num_heads, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(splits, n_rows * block, num_heads, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    tiles = n_rows * (block // SPLIT_BLOCK_M) * num_heads
    counts, indices = index.counts.contiguous(), index.indices.contiguous()
    _split_attention_kernel[(tiles, splits)](
        q, k_cache, v_cache, page_table, cu_seqlens_q, seqlens_k, layout.qblock_seq, layout.qblock_pos,
        counts, indices, long_rows, part_acc, part_max, part_sum,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
        indices.stride(0), indices.stride(1), counts.stride(0),
        n_rows, per_split, scale * LOG2E,
        GROUP=num_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK=block, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=SPLIT_BLOCK_M, BLOCK_N=SPLIT_BLOCK_N, num_warps=4, num_stages=1 if INTERPRET else 2,
    )  # fmt: skip
    _merge_splits_kernel[(tiles,)](
        part_acc, part_max, part_sum, long_rows, layout.qblock_seq, layout.qblock_pos, cu_seqlens_q, seqlens_k,
        out, lse, out.stride(0), out.stride(1), lse.stride(0), n_rows, splits,
        HEAD_DIM=head_dim, BLOCK=block, BLOCK_M=SPLIT_BLOCK_M, num_warps=4,
    )  # fmt: skip
