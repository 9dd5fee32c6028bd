"""Attention in plain PyTorch, computed in float32 by default: exact causal attention over a paged
cache (also the dense fallback for inputs the kernels do not support) and attention restricted to
the blocks an index keeps, what the attention kernel (attention.py) computes."""

from __future__ import annotations

import torch

from ..layout import BlockIndex
from .search_reference import pooled_blocks
from .staging_reference import default_scale, gather_kv, sequences


def _attend(q, k, v, allowed, scale, extra_logits=None, extra_values=None):
    """Softmax attention of q (Q, Hq, D) over k, v (K, Hq, D) under allowed (Hq, Q, K).

    ``extra_logits`` (Hq, Q, E) and ``extra_values`` (Hq, E, D) add virtual keys (mean correction).
    Returns out (Q, Hq, D) and natural-log lse (Hq, Q). Rows with no allowed key give zeros and -inf.
    """
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    logits = logits.masked_fill(~allowed, float("-inf"))
    values = v.transpose(0, 1)
    if extra_logits is not None:
        logits = torch.cat([logits, extra_logits], dim=-1)
        values = torch.cat([values, extra_values], dim=1)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.unsqueeze(-1).clamp(min=torch.finfo(logits.dtype).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("hqk,hkd->qhd", probs, values)
    return out, lse


def dense_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    query_chunk: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention over a paged KV cache.

    Shapes as in :func:`prefill_accel.sparse_prefill_attention`. Returns ``out`` (total_q, Hq, D) in
    ``compute_dtype`` and ``lse`` (Hq, total_q) float32. Queries are processed ``query_chunk`` rows at
    a time so long sequences fit in memory.
    """
    total_q, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    scale = default_scale(head_dim, softmax_scale)
    out = torch.zeros(total_q, num_heads, head_dim, dtype=compute_dtype, device=q.device)
    lse = torch.full((num_heads, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for seq, start, end, k_len in sequences(cu_seqlens_q, seqlens_k):
        k = gather_kv(k_cache, page_table, seq, k_len).to(compute_dtype).repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, page_table, seq, k_len).to(compute_dtype).repeat_interleave(group, dim=1)
        prefix = k_len - (end - start)
        key_pos = torch.arange(k_len, device=q.device)
        for row in range(start, end, query_chunk):
            rows = slice(row, min(row + query_chunk, end))
            q_pos = prefix + torch.arange(rows.start - start, rows.stop - start, device=q.device)
            allowed = (key_pos[None, :] <= q_pos[:, None]).expand(num_heads, -1, -1)
            o, l = _attend(q[rows].to(compute_dtype), k, v, allowed, scale)
            out[rows], lse[:, rows] = o, l.float()
    return out, lse


def block_masked_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    index: BlockIndex,
    softmax_scale: float | None = None,
    mean_correction: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention restricted to the key blocks an index keeps.

    With ``mean_correction`` every pruned key block strictly before a query block (fully visible to
    all its queries) contributes one virtual key: its mean key with logit scale * q . mean_key +
    ln(block length), and its mean value. Returns out (total_q, Hq, D) and lse (Hq, total_q).
    """
    layout = index.layout
    block = layout.block_size
    total_q, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[2]
    scale = default_scale(head_dim, softmax_scale)
    mask = index.to_mask().repeat_interleave(group, dim=1)  # (total_qb, Hq, n_blocks)
    out = torch.zeros(total_q, num_heads, head_dim, dtype=compute_dtype, device=q.device)
    lse = torch.full((num_heads, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for seq, start, end, k_len in sequences(cu_seqlens_q, seqlens_k):
        if end == start:
            continue
        k = gather_kv(k_cache, page_table, seq, k_len).to(compute_dtype).repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, page_table, seq, k_len).to(compute_dtype).repeat_interleave(group, dim=1)
        prefix = k_len - (end - start)
        q_pos = prefix + torch.arange(end - start, device=q.device)
        key_pos = torch.arange(k_len, device=q.device)
        qb_first = layout.seq_qblock_start[seq]
        row_mask = mask[qb_first + q_pos // block - prefix // block]  # (Q, Hq, n_blocks)
        key_block = key_pos // block
        allowed = row_mask[:, :, key_block].permute(1, 0, 2) & (key_pos[None, None, :] <= q_pos[None, :, None])
        extra_logits = extra_values = None
        if mean_correction:
            mean_k, sizes = pooled_blocks(k, block)
            mean_v, _ = pooled_blocks(v, block)
            n_blocks = mean_k.shape[0]
            visible = torch.arange(n_blocks, device=q.device)[None, :] < (q_pos // block)[:, None]
            pruned = visible[:, None, :] & ~row_mask[:, :, :n_blocks]  # (Q, Hq, n_blocks)
            extra_logits = torch.einsum("qhd,jhd->hqj", q[start:end].to(compute_dtype), mean_k) * scale
            extra_logits = extra_logits + torch.log(sizes)
            extra_logits = extra_logits.masked_fill(~pruned.permute(1, 0, 2), float("-inf"))
            extra_values = mean_v.transpose(0, 1)
        o, l = _attend(q[start:end].to(compute_dtype), k, v, allowed, scale, extra_logits, extra_values)
        out[start:end], lse[:, start:end] = o, l.float()
    return out, lse


def split_plan(counts: torch.Tensor, group: int, slots: int, capacity: int, min_blocks: int, max_splits: int,
               over_ranges: int):
    """The split-KV plan of a sparse launch (attention._plan_splits_kernel) from its kept-block counts
    (total_q_blocks, num_kv_heads): a row whose walk over its kept blocks before the diagonal is
    longer than ``over_ranges`` ranges of ``max(ceil(walked * group / slots), min_blocks)`` blocks walks them in
    such ranges, at most ``max_splits`` of them, and
    a row of several ranges takes that many consecutive scratch slots, in row order, while they last.
    Returns per row its ranges, and per slot its row (-1 where unused) and range."""
    walks = counts.flatten().long().cpu() - 1
    per_split = max(-(-int(walks.sum()) * group // slots), min_blocks)
    row_splits = []
    slot_row, slot_split = [-1] * capacity, [0] * capacity
    used = 0
    for row, walk in enumerate(walks.tolist()):
        splits = min(-(-walk // per_split), max_splits) if walk > over_ranges * per_split else 1
        if splits > 1 and used + splits <= capacity:
            row_splits.append(splits)
            slot_row[used : used + splits] = [row] * splits
            slot_split[used : used + splits] = range(splits)
        else:
            row_splits.append(1)
        used += splits if splits > 1 else 0
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return as_int(row_splits).view(counts.shape), as_int(slot_row), as_int(slot_split)
