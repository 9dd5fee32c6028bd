"""The block search: pooled (mean, maximum, minimum) key blocks, the selection kernel that
estimates each causal key block's share of attention and keeps the blocks that matter, and the
exact estimate over sampled query rows. The reference is search_reference.py."""

import torch
import triton
import triton.language as tl

from ..config import SparsePrefillConfig
from ..layout import BatchLayout, BlockIndex
from .common import INTERPRET, LOG2E, dot, jit_per_batch, kv_slots
from .launch import EXACT_TILE_ROWS, exact_splits, search_launch


@jit_per_batch("page_table", "seqlens_k", "stride_pt")
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
            page, slot = kv_slots(page_table + b * stride_pt, pos, PAGE_SIZE, valid)
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


@triton.jit
def _pooled_logits(q_rows, q_negative, keys_seq, low_seq, j, n_causal, k_len, qk_scale, stride_pj, dims,
                   BLOCK: tl.constexpr, BOUND: tl.constexpr):  # fmt: skip
    """Scaled (log2) logits of ``q_rows`` against the pooled keys ``keys_seq`` (in q's dtype) of key blocks ``j``,
    plus the log of each block's length; -inf past the causal blocks. With BOUND, ``q_rows`` is the
    rows' positive part and the logits are the bound q+ . max_key + q- . min_key (``low_seq`` the
    minima, ``q_negative`` the rows' negative part)."""
    causal = j[:, None] < n_causal
    keys = tl.load(keys_seq + j[:, None] * stride_pj + dims[None, :], mask=causal, other=0.0)
    dots = dot(q_rows, tl.trans(keys))
    if BOUND:
        low = tl.load(low_seq + j[:, None] * stride_pj + dims[None, :], mask=causal, other=0.0)
        dots += dot(q_negative, tl.trans(low))
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


@jit_per_batch("cu_seqlens_q", "seqlens_k", "stride_sr", "stride_sh")
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
    ``launch`` overrides the search kernel's rows per chunk, key tile and launch options (ROW_CHUNK,
    BLOCK_J, num_warps, num_stages), for timing them."""
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
    row_chunk, options = search_launch(head_dim, group * rows, with_means, with_bounds)
    options |= launch or {}
    row_chunk = options.pop("ROW_CHUNK", row_chunk)
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
        q.stride(0), q.stride(1), *((0, 0, 0) if exact else pooled.stride()[:3]),  # exact reads no pooled keys
        scores.stride(0), scores.stride(1),
        scale * LOG2E, config.threshold, config.target_mass, config.sink_blocks, config.local_blocks,
        GROUP=group, HEAD_DIM=head_dim, BLOCK=config.block_size, STRIDE=config.query_stride,
        ROWS=rows, ROW_CHUNK=row_chunk, PRESCORED=exact, MEANS=with_means, BOUNDS=with_bounds, **options,
    )  # fmt: skip
    return BlockIndex(layout=layout, counts=counts, indices=indices, scores=scores)


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
    page, slot = kv_slots(table, key_pos, PAGE_SIZE, key_valid)
    rows = page * stride_kp + slot * stride_ks + h * stride_kh
    keys = tl.load(k_cache + rows[:, None] + dims[None, :], mask=key_valid[:, None], other=0.0)
    logits = dot(q_rows, tl.trans(keys)) * qk_scale
    allowed = mine[:, None] & (key_pos[None, :] <= row_pos[:, None]) & key_valid[None, :]
    return tl.where(allowed, logits, float("-inf"))


@jit_per_batch("page_table", "cu_seqlens_q", "seqlens_k", "stride_pt", "stride_sr", "stride_sh", "total_q_blocks",
               "split_blocks")  # fmt: skip
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
