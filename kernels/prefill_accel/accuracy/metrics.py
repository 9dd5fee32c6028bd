"""Accuracy metrics: output error, KL of next-token distributions, and block-selection quality."""

from __future__ import annotations

import torch

MASS_CHUNK_ELEMENTS = 1 << 27
"""Attention probabilities materialised at once by :func:`block_attention_mass` (512 MiB in fp32)."""


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| over all elements, in float32."""
    exact = exact.float()
    return float(torch.linalg.vector_norm(approx.float() - exact) / torch.linalg.vector_norm(exact).clamp(min=1e-30))


def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row of two (rows, vocab) logit tensors, in float32 (natural log)."""
    log_p = torch.log_softmax(logits_p.float(), dim=-1)
    log_q = torch.log_softmax(logits_q.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def block_attention_mass(q: torch.Tensor, k: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Share of attention mass each query block gives each key block, from exact causal attention.

    Args:
        q: (L, Hq, D) queries of one sequence at positions 0..L-1.
        k: (L, Hkv, D) keys; Hq is a multiple of Hkv.
    Returns:
        (num_blocks, Hkv, num_blocks) float32: ``mass[i, h, j]`` is the attention probability that the
        rows of query block i put on key block j, averaged over the rows and over the query heads of
        KV head h's group; each row sums to 1. Query rows are processed in block-aligned chunks so
        that at most :data:`MASS_CHUNK_ELEMENTS` probabilities exist at once.
    """
    length, num_heads, _ = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    n_blocks = -(-length // block_size)
    padded_len = n_blocks * block_size
    keys = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, L, D)
    rows_per_chunk = max(block_size, MASS_CHUNK_ELEMENTS // (num_heads * padded_len) // block_size * block_size)
    key_pos = torch.arange(length, device=q.device)
    mass = torch.zeros(n_blocks, num_heads, n_blocks, dtype=torch.float32, device=q.device)
    for start in range(0, length, rows_per_chunk):
        stop = min(start + rows_per_chunk, length)
        q_pos = torch.arange(start, stop, device=q.device)
        logits = torch.einsum("qhd,hkd->hqk", q[start:stop].float(), keys) * scale
        logits.masked_fill_(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        probs = torch.nn.functional.pad(probs, (0, padded_len - length))
        per_block = probs.view(num_heads, stop - start, n_blocks, block_size).sum(-1)  # (Hq, rows, nb)
        first_block = start // block_size
        n_rows_blocks = -(-(stop - start) // block_size)
        per_block = torch.nn.functional.pad(per_block, (0, 0, 0, n_rows_blocks * block_size - (stop - start)))
        summed = per_block.view(num_heads, n_rows_blocks, block_size, n_blocks).sum(2)
        mass[first_block : first_block + n_rows_blocks] = summed.transpose(0, 1)
    rows_in_block = torch.full((n_blocks,), float(block_size), device=q.device)
    rows_in_block[-1] = length - (n_blocks - 1) * block_size
    mass /= rows_in_block.view(-1, 1, 1)
    return mass.view(n_blocks, num_kv, group, n_blocks).mean(2)


def oracle_counts(mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Fewest key blocks per row of ``mass`` (..., nb) whose mass reaches ``target`` (...,) (a share <= 1)."""
    ordered = mass.sort(dim=-1, descending=True).values.cumsum(-1)
    # Float slack: the kept set itself reaches its own recall, so the oracle must not need more blocks.
    short = ordered < (target.unsqueeze(-1) - 1e-6)
    return (short.sum(-1) + 1).clamp(max=mass.shape[-1])


def selection_quality(mass: torch.Tensor, kept: torch.Tensor, recall_target: float = 0.95) -> dict[str, float]:
    """Attention-mass recall of a block mask and the oracle densities it is judged against.

    Args:
        mass: (num_blocks, Hkv, num_blocks) from :func:`block_attention_mass`.
        kept: (num_blocks, Hkv, num_blocks) bool, the blocks a selection kept (causal blocks only).
    Returns:
        ``recall``: the kept share of each (query block, KV head)'s mass, averaged;
        ``density``: kept blocks over causal blocks;
        ``oracle_density``: blocks over causal blocks when each row keeps the fewest blocks that hold
        the mass the selection recalled in that row (so it is never above ``density``);
        ``oracle_density_95``: the same for ``recall_target`` of each row's mass.
    """
    n_blocks = mass.shape[0]
    causal = torch.arange(n_blocks, device=mass.device)[None, :] <= torch.arange(n_blocks, device=mass.device)[:, None]
    kept = kept[:, :, :n_blocks] & causal[:, None, :]
    causal_count = float(causal.sum()) * mass.shape[1]
    recall = (mass * kept).sum(-1)
    row_total = mass.sum(-1)
    full = torch.full_like(recall, recall_target) * row_total
    return {
        "recall": float((recall / row_total.clamp(min=1e-30)).mean()),
        "density": float(kept.sum()) / causal_count,
        "oracle_density": float(oracle_counts(mass, recall).sum()) / causal_count,
        "oracle_density_95": float(oracle_counts(mass, full).sum()) / causal_count,
    }
