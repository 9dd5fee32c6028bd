"""Block-sparse FlashAttention over a paged cache: one program per tile of queries and query head
walks the key blocks the search kept (every causal block in dense mode), the diagonal block
masked causally, optionally the pruned blocks through their mean key and value; rows far longer
than the launch's others split over several programs and merged (split-KV, planned on the GPU from
the kept-block counts). The reference is attention_reference.py."""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..layout import BatchLayout, BlockIndex
from . import launch, staging
from .common import LOG2E, TENSOR_DESCRIPTORS, TMA_NEEDS_TRITON, dot, jit_per_batch, kv_tile
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
    key=["HEAD_DIM", "BLOCK", "PAGE_SIZE", "DENSE", "GROUP", "TMA", "RANGES", "size_class"],
    prune_configs_by={"early_config_prune": launch.prune_attention_configs},
)
@jit_per_batch("page_table", "cu_seqlens_q", "seqlens_k", "stride_pt", "stride_lh", "stride_ir", "stride_ih",
               "total_q_blocks", "kv_head_base", "launch_kv_heads")  # fmt: skip
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
    row_splits,
    slot_row,
    slot_split,
    part_acc,
    part_max,
    part_sum,
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
    launch_kv_heads,
    qk_scale,
    size_class,  # autotuning key only (_size_class)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DENSE: tl.constexpr,
    MEAN_CORRECTION: tl.constexpr,
    SPLIT: tl.constexpr,
    RANGES: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One tile of BLOCK_M queries of one query head: online-softmax attention over the kept key
    blocks (all causal blocks when DENSE), the diagonal block masked causally, then optionally the
    pruned fully visible blocks through their mean key and value. Writes out and natural-log lse.
    The launch covers the query heads of KV heads ``kv_head_base ..`` (``launch_kv_heads`` of them);
    with TMA, K and V come through ``k_desc``/``v_desc``, whose columns start at KV head ``kv_head_base``.

    Split rows (see _plan_splits_kernel): with SPLIT the rows (query block, KV head) that
    ``row_splits`` cuts into several key ranges are left out; the RANGES launch, one program per
    scratch slot of ``slot_row``/``slot_split``, head of the group and query tile, walks those ranges
    (the diagonal with range 0) and leaves float32 partials for _merge_splits_kernel. Two
    specialisations rather than one kernel deciding per program, whose extra branches slowed every
    walk (docs/benchmarks.md, Split-KV by kept blocks)."""
    SUB_M: tl.constexpr = BLOCK // BLOCK_M
    SUB_N: tl.constexpr = BLOCK // BLOCK_N
    pid = tl.program_id(0)
    split = 0
    if RANGES:
        slot = pid // (GROUP * SUB_M)
        row = tl.load(slot_row + slot)
        split = tl.load(slot_split + slot)
        kv_head = tl.maximum(row, 0) % stride_cr  # counts and the plan: (total_q_blocks, num_kv_heads), contiguous
        qb = tl.maximum(row, 0) // stride_cr
        head = kv_head * GROUP + pid % GROUP
        sub = (pid // GROUP) % SUB_M
        mine = (row >= 0) & (kv_head >= kv_head_base) & (kv_head < kv_head_base + launch_kv_heads)
    else:
        # Query heads vary fastest across programs, so the heads of a KV group, which keep the same
        # blocks, run side by side and share K/V tiles in L2; the heaviest (latest) query blocks start first.
        launch_heads = launch_kv_heads * GROUP
        head = kv_head_base * GROUP + pid % launch_heads
        tile = pid // launch_heads
        kv_head = head // GROUP
        qb = total_q_blocks - 1 - tile // SUB_M
        sub = tile % SUB_M
    kv_column = (kv_head - kv_head_base) * HEAD_DIM
    seq, pos, k_len, prefix, q_pos, q_valid, q_rows, last_row = _query_tile(
        qblock_seq, qblock_pos, cu_seqlens_q, seqlens_k, qb, sub, BLOCK, BLOCK_M
    )
    todo = (last_row >= prefix) & (pos * BLOCK + sub * BLOCK_M < k_len)
    if RANGES:
        todo = todo & mine
    elif SPLIT:
        todo = todo & (tl.load(row_splits + qb * stride_cr + kv_head) == 1)
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
            first, last = 0, pos
        else:
            first, last = 0, tl.load(counts + qb * stride_cr + kv_head) - 1
            if RANGES:
                per_split = tl.cdiv(last, tl.load(row_splits + qb * stride_cr + kv_head))
                first = tl.minimum(split * per_split, last)
                last = tl.minimum(first + per_split, last)
        row_max, row_sum, acc = _attend_kept(
            q_tile, k_cache, v_cache, k_desc, v_desc, pt_row, indices, index_row, first * SUB_N, last * SUB_N, kv_head,
            kv_column, row_max, row_sum, acc, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            HEAD_DIM, BLOCK, PAGE_SIZE, DENSE, BLOCK_N, TMA,
        )  # fmt: skip
        if split == 0:
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
                    logits = dot(q_tile, tl.trans(mean_k.to(q_tile.dtype))) * qk_scale + tl.log2(BLOCK * 1.0)
                    logits = tl.where(pruned[None, :], logits, float("-inf"))
                    mean_v = tl.load(pooled_v + pooled_row + j[:, None] * stride_pj + dims[None, :], mask=pruned[:, None], other=0.0)
                    row_max, row_sum, acc = _online_softmax_step(logits, mean_v, row_max, row_sum, acc)

        if RANGES:  # part_*: (scratch slots, BLOCK, GROUP[, HEAD_DIM]), contiguous
            rows = ((slot * BLOCK + sub * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64) * GROUP + head % GROUP)
            tl.store(part_max + rows, row_max)
            tl.store(part_sum + rows, row_sum)
            tl.store(part_acc + rows[:, None] * HEAD_DIM + dims[None, :], acc)
        else:
            acc = acc / row_sum[:, None]
            tl.store(out + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :], acc.to(out.dtype.element_ty), mask=q_valid[:, None])
            tl.store(lse + head * stride_lh + q_rows, (row_max + tl.log2(row_sum)) / 1.4426950408889634, mask=q_valid)


@jit_per_batch("n_rows", "capacity", "slots")
def _plan_splits_kernel(
    counts, row_splits, slot_row, slot_split, n_rows, capacity, slots,
    GROUP: tl.constexpr, MIN_BLOCKS: tl.constexpr, MAX_SPLITS: tl.constexpr, OVER_RANGES: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """One program: how many key ranges each row (query block, KV head) of ``counts`` walks in, and
    which scratch slots hold their partials. A range holds the launch's kept blocks x GROUP (the
    row's heads each walk it) over ``slots`` program slots, at least MIN_BLOCKS; a row splits only
    when its walk exceeds OVER_RANGES ranges, and rows past ``capacity`` slots stay whole. Writes ``row_splits`` per row, and per slot its row (-1 where
    unused) and range: a split row's ranges take consecutive slots, in row order."""
    total = 0
    for start in range(0, n_rows, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        total += tl.sum(tl.load(counts + rows, mask=rows < n_rows, other=1) - 1)
    per_split = tl.maximum(tl.cdiv(total * GROUP, slots), MIN_BLOCKS)
    for start in range(0, capacity, CHUNK):
        at = start + tl.arange(0, CHUNK)
        tl.store(slot_row + at, -1, mask=at < capacity)
    tl.debug_barrier()  # every slot cleared before the rows claim theirs
    used = 0
    for start in range(0, n_rows, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        valid = rows < n_rows
        walk = tl.load(counts + rows, mask=valid, other=1) - 1
        splits = tl.where(walk > OVER_RANGES * per_split, tl.minimum(tl.cdiv(walk, per_split), MAX_SPLITS), 1)
        held = tl.where(valid & (splits > 1), splits, 0)
        end = used + tl.cumsum(held, 0)
        first = end - held
        splits = tl.where((held > 0) & (end <= capacity), splits, 1)
        tl.store(row_splits + rows, splits, mask=valid)
        for split in tl.static_range(MAX_SPLITS):
            claim = valid & (split < splits) & (splits > 1)
            tl.store(slot_row + first + split, rows, mask=claim)
            tl.store(slot_split + first + split, split, mask=claim)
        used += tl.sum(held)


@jit_per_batch("cu_seqlens_q", "seqlens_k", "stride_lh", "stride_cr")
def _merge_splits_kernel(
    part_acc, part_max, part_sum, row_splits, slot_row, slot_split, qblock_seq, qblock_pos, cu_seqlens_q, seqlens_k,
    out, lse, stride_ot, stride_oh, stride_lh, stride_cr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Combine the partials of one split row, one tile of BLOCK_M queries of one of its query heads,
    through their row maxima and sums into out and natural-log lse. Programs go by scratch slot
    (GROUP x BLOCK // BLOCK_M per slot); the slot of a row's range 0 merges the row, the others exit."""
    SUB_M: tl.constexpr = BLOCK // BLOCK_M
    slot = tl.program_id(0) // (GROUP * SUB_M)
    row = tl.load(slot_row + slot)
    if (row >= 0) & (tl.load(slot_split + slot) == 0):
        qb = row // stride_cr
        kv_head = row % stride_cr
        group_head = tl.program_id(0) % GROUP
        head = kv_head * GROUP + group_head
        sub = (tl.program_id(0) // GROUP) % SUB_M
        seq, pos, k_len, prefix, q_pos, q_valid, q_rows, last_row = _query_tile(
            qblock_seq, qblock_pos, cu_seqlens_q, seqlens_k, qb, sub, BLOCK, BLOCK_M
        )
        if (last_row >= prefix) & (pos * BLOCK + sub * BLOCK_M < k_len):
            dims = tl.arange(0, HEAD_DIM)
            # part_*: (scratch slots, BLOCK, GROUP[, HEAD_DIM]), contiguous; range 0 holds the diagonal,
            # so its maximum is finite on every row of the step. Rows outside the step were never
            # written (their attention tile may have had nothing to do): read as an empty softmax.
            rows = ((slot * BLOCK + sub * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)) * GROUP + group_head
            row_max = tl.load(part_max + rows, mask=q_valid, other=0.0)
            row_sum = tl.load(part_sum + rows, mask=q_valid, other=1.0)
            acc = tl.load(part_acc + rows[:, None] * HEAD_DIM + dims[None, :], mask=q_valid[:, None], other=0.0)
            for split in range(1, tl.load(row_splits + row)):
                split_rows = rows + split * BLOCK * GROUP
                split_max = tl.load(part_max + split_rows, mask=q_valid, other=0.0)
                new_max = tl.maximum(row_max, split_max)
                keep = tl.exp2(row_max - new_max)
                add = tl.exp2(split_max - new_max)
                row_sum = row_sum * keep + tl.load(part_sum + split_rows, mask=q_valid, other=0.0) * add
                split_acc = tl.load(part_acc + split_rows[:, None] * HEAD_DIM + dims[None, :], mask=q_valid[:, None], other=0.0)
                acc = acc * keep[:, None] + split_acc * add[:, None]
                row_max = new_max
            acc = acc / row_sum[:, None]
            tl.store(out + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :], acc.to(out.dtype.element_ty), mask=q_valid[:, None])
            tl.store(lse + head * stride_lh + q_rows, (row_max + tl.log2(row_sum)) / 1.4426950408889634, mask=q_valid)


@dataclass
class _SplitPlan:
    """Where the split rows of a sparse launch keep their partial results (see _plan_splits_kernel)."""

    row_splits: torch.Tensor  # (total_q_blocks, num_kv_heads) int32
    slot_row: torch.Tensor  # (capacity,) int32
    slot_split: torch.Tensor  # (capacity,) int32
    part_acc: torch.Tensor  # (capacity, block, group, head_dim) float32
    part_max: torch.Tensor  # (capacity, block, group) float32
    part_sum: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.slot_row.numel()


def _plan_splits(counts: torch.Tensor, block: int, group: int, head_dim: int) -> _SplitPlan:
    """The split plan of a sparse launch, computed on the GPU from the kept-block counts (no host read)."""
    slots, capacity = launch.split_slots(group, launch.multiprocessors(counts.device))
    device = counts.device
    plan = _SplitPlan(
        row_splits=torch.empty_like(counts),
        slot_row=torch.empty(capacity, dtype=torch.int32, device=device),
        slot_split=torch.empty(capacity, dtype=torch.int32, device=device),
        part_acc=torch.empty(capacity, block, group, head_dim, dtype=torch.float32, device=device),
        part_max=torch.empty(capacity, block, group, dtype=torch.float32, device=device),
        part_sum=torch.empty(capacity, block, group, dtype=torch.float32, device=device),
    )
    _plan_splits_kernel[(1,)](
        counts, plan.row_splits, plan.slot_row, plan.slot_split, counts.numel(), capacity, slots,
        GROUP=group, MIN_BLOCKS=launch.MIN_SPLIT_BLOCKS, MAX_SPLITS=launch.MAX_SPLITS,
        OVER_RANGES=launch.SPLIT_OVER_RANGES, CHUNK=1024, num_warps=4,
    )  # fmt: skip
    return plan


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
    A sparse launch splits the longest walks over the keys (split-KV, planned on the GPU from the
    kept-block counts: _plan_splits_kernel). ``tile`` runs one tile shape instead of the autotuned
    choice and ``split_kv=False`` leaves every row to one program: both for benchmarks that compare variants."""
    total_q, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(num_heads, total_q, dtype=torch.float32, device=q.device)
    if layout.total_q_blocks == 0:
        return out, lse
    dense = index is None
    group = num_heads // num_kv
    placeholder = torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device)
    counts = indices = keep_mask = placeholder
    pooled_k = pooled_v = placeholder.float().unsqueeze(0)
    plan = None
    if not dense:
        counts, indices = index.counts.contiguous(), index.indices.contiguous()
        if mean_correction:
            keep_mask = index.to_mask().to(torch.int8)  # same shape, so same strides, as indices
            pooled_k = pool_blocks(k_cache, page_table, seqlens_k, layout)[0]
            pooled_v = pool_blocks(v_cache, page_table, seqlens_k, layout)[0]
        if split_kv and launch.plans_splits(layout.total_q_blocks * num_heads):
            plan = _plan_splits(counts, layout.block_size, group, head_dim)
    flat, flat_float = placeholder.view(-1), placeholder.view(-1).float()
    plan_args = (flat, flat, flat, flat_float, flat_float, flat_float) if plan is None else (
        plan.row_splits, plan.slot_row, plan.slot_split, plan.part_acc, plan.part_max, plan.part_sum)
    kernel, tile_args = _attention_kernel, {}
    if tile is not None:
        kernel = _attention_kernel.fn
        tile_args = dict(tile.kwargs, num_warps=tile.num_warps, num_stages=tile.num_stages)

    def attend(keys, values, table, descriptors, kv_heads: range) -> None:
        if tile is not None and descriptors[0] is not None:
            launch.set_descriptor_blocks(dict(zip(("k_desc", "v_desc"), descriptors), HEAD_DIM=head_dim, **tile.kwargs))
        tiles_per_block = lambda meta: layout.block_size // meta["BLOCK_M"]  # noqa: E731
        programs = layout.total_q_blocks * len(kv_heads) * group
        launches = [(False, programs)] if plan is None else [(True, plan.capacity * group), (False, programs)]
        for ranges, count in launches:  # the split rows' ranges first: the heaviest walks start first
            kernel[lambda meta: (count * tiles_per_block(meta),)](  # noqa: B023
                q, keys, values, *descriptors, table, cu_seqlens_q, seqlens_k, layout.qblock_seq, layout.qblock_pos,
                counts, indices, keep_mask, pooled_k, pooled_v, *plan_args, out, lse,
                q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
                values.stride(0), values.stride(1), values.stride(2), table.stride(0),
                out.stride(0), out.stride(1), lse.stride(0),
                indices.stride(0), indices.stride(1), counts.stride(0),
                pooled_k.stride(0), pooled_k.stride(1), pooled_k.stride(2),
                layout.total_q_blocks, kv_heads.start, len(kv_heads), scale * LOG2E, launch.size_class(count),
                GROUP=group, HEAD_DIM=head_dim, BLOCK=layout.block_size, PAGE_SIZE=keys.shape[1],
                DENSE=dense, MEAN_CORRECTION=mean_correction and not dense, SPLIT=plan is not None, RANGES=ranges,
                TMA=descriptors[0] is not None, **tile_args,
            )  # fmt: skip

    sparse_context = 0 if dense else max(layout.k_lens)
    mode = launch.kv_read_mode(q, k_cache, v_cache, sparse_context) if kv_reads == "auto" else kv_reads
    if mode == "tma" and not TENSOR_DESCRIPTORS:
        raise ValueError(f"kv_reads='tma' needs Triton >= {TMA_NEEDS_TRITON} (tensor descriptors); "
                         f"this is {triton.__version__}")
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
    if plan is not None:
        merge_m = min(launch.MERGE_BLOCK_M, layout.block_size)
        _merge_splits_kernel[(plan.capacity * group * (layout.block_size // merge_m),)](
            plan.part_acc, plan.part_max, plan.part_sum, plan.row_splits, plan.slot_row, plan.slot_split,
            layout.qblock_seq, layout.qblock_pos, cu_seqlens_q, seqlens_k, out, lse,
            out.stride(0), out.stride(1), lse.stride(0), counts.stride(0),
            GROUP=group, HEAD_DIM=head_dim, BLOCK=layout.block_size, BLOCK_M=merge_m, num_warps=4,
        )  # fmt: skip
    return out, lse
