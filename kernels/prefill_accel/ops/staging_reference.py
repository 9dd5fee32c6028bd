"""Plain-PyTorch reads of a paged batch, the reference of staging.py and what the other references
read their keys and values with."""

from __future__ import annotations

import math

import torch


def gather_kv(cache: torch.Tensor, page_table: torch.Tensor, seq: int, length: int) -> torch.Tensor:
    """Contiguous (length, num_kv_heads, head_dim) keys or values of one sequence of a paged cache."""
    page_size = cache.shape[1]
    pages = page_table[seq, : -(-length // page_size)].long()
    return cache.index_select(0, pages).flatten(0, 1)[:length]


def sequences(cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor):
    """(sequence, first packed query row, row past its last, key length) of each sequence of a batch."""
    cu_q = cu_seqlens_q.tolist()
    for seq, k_len in enumerate(seqlens_k.tolist()):
        yield seq, cu_q[seq], cu_q[seq + 1], k_len


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The softmax scale a reference applies: the one given, else 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
