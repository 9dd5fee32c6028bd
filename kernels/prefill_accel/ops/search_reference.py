"""The block search in plain PyTorch, computed in float64 by default: what the search kernels
(search.py) compute, the search for inputs they do not support, and what the tests compare with."""

from __future__ import annotations

import torch

from ..config import SparsePrefillConfig
from ..layout import BatchLayout, BlockIndex
from .staging_reference import default_scale, gather_kv


def pooled_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of each block of ``block_size`` rows of x (L, H, D), and each block's length."""
    length = x.shape[0]
    n = -(-length // block_size)
    padded = torch.zeros(n * block_size, *x.shape[1:], dtype=x.dtype, device=x.device)
    padded[:length] = x
    sizes = torch.full((n,), block_size, dtype=x.dtype, device=x.device)
    sizes[-1] = length - (n - 1) * block_size
    sums = padded.view(n, block_size, *x.shape[1:]).sum(1)
    return sums / sizes.view(-1, *([1] * (x.dim() - 1))), sizes


def bounding_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elementwise largest and smallest row of each block of ``block_size`` rows of x (L, H, D), and
    each block's length."""
    length = x.shape[0]
    n = -(-length // block_size)
    padded = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, n * block_size - length), value=float("nan"))
    blocks = padded.view(n, block_size, *x.shape[1:])
    sizes = torch.full((n,), block_size, dtype=x.dtype, device=x.device)
    sizes[-1] = length - (n - 1) * block_size
    return blocks.nan_to_num(float("-inf")).amax(1), blocks.nan_to_num(float("inf")).amin(1), sizes


def _scored_rows(layout: BatchLayout, config: SparsePrefillConfig, qb: int) -> tuple[int, int, list[int]]:
    """Sequence, block position and the absolute query positions the search scores for query block qb.

    The pooled, bound and mixed estimates score every ``query_stride``-th row of the block; the exact estimate
    ``exact_rows`` evenly spaced rows ending at the block's last row, a row past the sequence's end
    moved to its last position (once)."""
    seq = int(layout.qblock_seq[qb])
    pos = int(layout.qblock_pos[qb])
    k_len, q_len = layout.k_lens[seq], layout.q_lens[seq]
    block = config.block_size
    if config.estimator == "exact":
        stride = block // config.exact_rows
        candidates = sorted({min(pos * block + (i + 1) * stride - 1, k_len - 1) for i in range(config.exact_rows)})
    else:
        stride = config.query_stride
        candidates = range(pos * block + stride - 1, (pos + 1) * block, stride)
    rows = [p for p in candidates if k_len - q_len <= p < k_len]
    return seq, pos, rows


def pooled_estimate(q_rows, mean_keys, sizes, scale):
    """(Hkv, blocks): softmax over the blocks of each row against the blocks' mean keys (+ ln of
    their lengths), averaged over the rows and the query heads of the group; q_rows (R, Hkv, G, D)."""
    logits = torch.einsum("rhgd,jhd->hrgj", q_rows, mean_keys) * scale + torch.log(sizes)
    return torch.softmax(logits, dim=-1).mean(dim=(1, 2))


def bound_estimate(q_rows, max_keys, min_keys, sizes, scale):
    """(Hkv, blocks): as pooled_estimate, with each row's logit for a block the upper bound of its
    logits over the block's keys, q+ . max_key + q- . min_key (q+ and q- the positive and negative parts)."""
    positive = q_rows.clamp(min=0)
    bound = torch.einsum("rhgd,jhd->hrgj", positive, max_keys) + torch.einsum("rhgd,jhd->hrgj", q_rows - positive, min_keys)
    return torch.softmax(bound * scale + torch.log(sizes), dim=-1).mean(dim=(1, 2))


def _exact_estimate(q_rows, keys, rows, block, scale):
    """(Hkv, blocks): each row's exact causal attention summed per key block, averaged over the rows
    and the query heads of the group; q_rows (R, Hkv, G, D) at absolute positions ``rows``."""
    length = keys.shape[0]
    logits = torch.einsum("rhgd,khd->hrgk", q_rows, keys) * scale
    key_pos = torch.arange(length, device=keys.device)
    row_pos = torch.tensor(rows, device=keys.device)
    logits = logits.masked_fill(key_pos[None, None, None, :] > row_pos[None, :, None, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).mean(dim=(1, 2))  # (Hkv, length)
    n_blocks = -(-length // block)
    padded = torch.nn.functional.pad(probs, (0, n_blocks * block - length))
    return padded.view(probs.shape[0], n_blocks, block).sum(-1)


def mass_cut(estimate: torch.Tensor, target: float) -> torch.Tensor:
    """Per row of ``estimate`` (..., n), the value of the smallest of the fewest largest entries
    whose sum reaches ``target``: keeping entries >= it keeps that mass. Shape (..., 1)."""
    ordered = estimate.sort(dim=-1, descending=True).values
    reached = ordered.cumsum(-1) >= target
    first = reached.float().argmax(dim=-1, keepdim=True)
    first = torch.where(reached.any(-1, keepdim=True), first, ordered.shape[-1] - 1)
    return ordered.gather(-1, first)


def select_blocks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    config: SparsePrefillConfig,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> BlockIndex:
    """Reference block-importance search; the Triton selection kernel computes the same index.

    For query block i, KV head h and causal key block j the estimate is a mean over the scored
    query rows r and the query heads g of the group. With the pooled estimator it averages
    softmax_j(scale * q_rg . mean_key_j + ln n_j), where n_j is the block's length: each row's
    attention over the blocks, with each block summarised by its mean key. With the exact one it
    averages the row's exact causal attention mass on the keys of block j. The bound estimator is the
    pooled one with ``q . mean_key_j`` replaced by the upper bound of ``q . k`` over the block's keys,
    ``q+ . max_key_j + q- . min_key_j`` (elementwise extremes of the keys); the mixed estimator is
    the mean of the pooled and bound estimates. A block is kept when
    its estimate is >= threshold x the row maximum, or (with target_mass > 0) it is among the
    fewest largest estimates holding target_mass, or it is a sink block, a local block, the
    diagonal block, or the query block is dense.
    """
    layout = BatchLayout.build(cu_seqlens_q, seqlens_k, config, q.device)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    scale = default_scale(head_dim, softmax_scale)
    n_blocks = layout.max_k_blocks
    scores = torch.zeros(layout.total_q_blocks, num_kv, n_blocks, dtype=torch.float32, device=q.device)
    keep = torch.zeros(layout.total_q_blocks, num_kv, n_blocks, dtype=torch.bool, device=q.device)
    cu_q = cu_seqlens_q.tolist()
    keys_of, pooled = {}, {}
    for qb in range(layout.total_q_blocks):
        seq, pos, rows = _scored_rows(layout, config, qb)
        causal = slice(0, pos + 1)
        if layout.qblock_dense[qb] or not rows:
            keep[qb, :, causal] = True
            continue
        if seq not in keys_of:
            keys_of[seq] = gather_kv(k_cache, page_table, seq, layout.k_lens[seq]).to(compute_dtype)
        prefix = layout.k_lens[seq] - layout.q_lens[seq]
        q_rows = q[[cu_q[seq] + p - prefix for p in rows]].to(compute_dtype)  # (R, Hq, D)
        q_rows = q_rows.view(len(rows), num_kv, group, head_dim)
        if config.estimator == "exact":
            keys = keys_of[seq][: max(rows) + 1]
            estimate = _exact_estimate(q_rows, keys, rows, config.block_size, scale)[:, causal]
        else:
            if seq not in pooled:
                pooled[seq] = pooled_blocks(keys_of[seq], config.block_size), bounding_blocks(keys_of[seq], config.block_size)
            (mean_keys, sizes), (max_keys, min_keys, _) = pooled[seq]
            estimates = []  # each (Hkv, pos + 1)
            if config.estimator in ("pooled", "mixed"):
                estimates.append(pooled_estimate(q_rows, mean_keys[causal], sizes[causal], scale))
            if config.estimator in ("bound", "mixed"):
                estimates.append(bound_estimate(q_rows, max_keys[causal], min_keys[causal], sizes[causal], scale))
            estimate = sum(estimates) / len(estimates)
        scores[qb, :, causal] = estimate.float()
        cut = config.threshold * estimate.amax(dim=-1, keepdim=True)
        if config.target_mass > 0:
            cut = torch.minimum(cut, mass_cut(estimate, config.target_mass))
        kept = estimate >= cut
        kept[:, : config.sink_blocks] = True
        kept[:, max(pos - config.local_blocks, 0) :] = True
        keep[qb, :, causal] = kept
    index = BlockIndex.from_mask(layout, keep)
    index.scores = scores
    return index
