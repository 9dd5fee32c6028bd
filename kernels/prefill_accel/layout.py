"""Batch layout of a varlen prefill step in blocks, and the block index that selection produces.

Blocks are aligned to absolute positions: query block ``i`` of a sequence holds the queries at
positions ``[i * B, (i + 1) * B)`` that belong to this step, and key block ``j`` the keys at
``[j * B, (j + 1) * B)``. A continuation chunk (prefix_len > 0) may therefore start in the middle
of its first query block. Query block ``i`` sees key blocks ``0 .. i`` and masks block ``i`` causally.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .config import SparsePrefillConfig


def causal_block_count(q_lens, k_lens, block: int) -> int:
    """(query block, key block) pairs allowed by causality in a batch, per KV head, from host lengths.

    Query block ``i`` sees key blocks ``0 .. i``: a sequence contributes the sum of ``i + 1`` over
    the query blocks that hold its queries of this step.
    """
    total = 0
    for q_len, k_len in zip(q_lens, k_lens):
        if q_len > 0:
            first, last = (k_len - q_len) // block + 1, -(-k_len // block)  # counts i + 1, inclusive
            total += (first + last) * (last - first + 1) // 2
    return total


@dataclass(frozen=True)
class BatchLayout:
    """Where each query block of a packed batch lives. Built once per step on the host."""

    block_size: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    qblock_seq: torch.Tensor
    """(total_q_blocks,) int32: the sequence of each query block."""
    qblock_pos: torch.Tensor
    """(total_q_blocks,) int32: each query block's absolute block index, also its diagonal key block."""
    qblock_dense: torch.Tensor
    """(total_q_blocks,) int8: 1 where the query block is computed over every causal key block."""
    seq_qblock_start: tuple[int, ...]
    """First global query block of each sequence; the last entry is the total."""
    all_dense: bool
    """Every query block is dense, so no search is needed (known on the host, no device read)."""
    config: SparsePrefillConfig
    """The configuration the layout was built for (its dense blocks depend on it)."""
    checked_page_tables: set = field(default_factory=set, compare=False, repr=False)
    """Page tables whose ids were found inside the cache for this layout (the public functions check once)."""

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def total_q_blocks(self) -> int:
        return self.seq_qblock_start[-1]

    @property
    def max_k_blocks(self) -> int:
        return max((-(-k // self.block_size) for k in self.k_lens), default=0)

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        return tuple(k - q for q, k in zip(self.q_lens, self.k_lens))

    def causal_blocks(self) -> int:
        """Number of (query block, key block) pairs allowed by causality, per KV head."""
        return causal_block_count(self.q_lens, self.k_lens, self.block_size)

    @cached_property
    def staging(self) -> "Staging":
        """Where the key blocks of the sequences with queries go in a staged copy of the cache
        (built on first use, once per layout)."""
        blocks = torch.tensor([-(-k // self.block_size) if q else 0 for q, k in zip(self.q_lens, self.k_lens)])
        pages = int(blocks.sum())
        seq = torch.repeat_interleave(torch.arange(self.batch, dtype=torch.int32), blocks)
        first_page = torch.cumsum(blocks, 0) - blocks
        block = torch.arange(pages, dtype=torch.int32) - first_page[seq.long()].to(torch.int32)
        table = torch.zeros(self.batch, max(self.max_k_blocks, 1), dtype=torch.int32)
        table[torch.arange(table.shape[1]) < blocks[:, None]] = torch.arange(pages, dtype=torch.int32)
        device = self.qblock_seq.device
        return Staging(seq=_to_device(seq, device), block=_to_device(block, device), table=_to_device(table, device))

    @classmethod
    def build(
        cls,
        cu_seqlens_q: torch.Tensor,
        seqlens_k: torch.Tensor,
        config: SparsePrefillConfig,
        device: torch.device,
    ) -> "BatchLayout":
        """Lay out the batch in blocks; reads the two small length tensors on the host once.

        Host (CPU) length tensors cost no device synchronisation: an engine that has them builds
        the layout once per step and passes it to every layer's call.
        """
        cu_q = cu_seqlens_q.detach().to("cpu", torch.int64).tolist()
        k_lens = seqlens_k.detach().to("cpu", torch.int64).tolist()
        q_lens = [cu_q[i + 1] - cu_q[i] for i in range(len(k_lens))]
        block = config.block_size
        seq_ids, positions, dense, starts = [], [], [], [0]
        for seq, (q_len, k_len) in enumerate(zip(q_lens, k_lens)):
            if q_len < 0 or q_len > k_len:
                raise ValueError(
                    f"sequence {seq}: query length {q_len} must lie in [0, seqlens_k={k_len}] "
                    "(queries are the last q_len positions of the sequence)"
                )
            first = (k_len - q_len) // block
            last = -(-k_len // block)  # one past the last query block
            n = last - first if q_len > 0 else 0
            # Whole runs at once, not a block at a time: a 128K prompt has a thousand query blocks.
            seq_ids += [seq] * n
            positions += range(first, first + n)
            long = not config.is_dense and config.long_chunk(q_len, k_len)
            dense_tail = min(config.last_query_blocks, n) if long else n
            dense += [0] * (n - dense_tail) + [1] * dense_tail
            starts.append(starts[-1] + n)

        def as_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            if not values:
                return torch.empty(0, dtype=dtype, device=device)
            # Through an array, not torch.tensor(list): a third of the time at a thousand values.
            typecode = "b" if dtype == torch.int8 else "i"
            return _to_device(torch.frombuffer(array.array(typecode, values), dtype=dtype), device)

        return cls(
            block_size=block,
            q_lens=tuple(q_lens),
            k_lens=tuple(k_lens),
            qblock_seq=as_tensor(seq_ids, torch.int32),
            qblock_pos=as_tensor(positions, torch.int32),
            qblock_dense=as_tensor(dense, torch.int8),
            seq_qblock_start=tuple(starts),
            all_dense=all(dense),
            config=config,
        )


def _to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on ``device``; to a GPU it is queued from pinned memory, the host does not wait."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Staging:
    """A contiguous copy of the key blocks a step reads, one page per block: staged page ``p``
    holds key block ``block[p]`` of sequence ``seq[p]``, and ``table`` (batch, max_k_blocks) is
    the page table of the copy (entries of sequences without queries are unused)."""

    seq: torch.Tensor
    block: torch.Tensor
    table: torch.Tensor

    @property
    def pages(self) -> int:
        return self.seq.numel()


@dataclass
class BlockIndex:
    """Kept key blocks per query block and KV head, as padded CSR rows.

    Row ``(qb, h)`` keeps ``counts[qb, h]`` key blocks, listed in ascending order in
    ``indices[qb, h, :counts[qb, h]]``; the diagonal block is always last. Entries past the count
    are unspecified.
    """

    layout: BatchLayout
    counts: torch.Tensor
    """(total_q_blocks, num_kv_heads) int32."""
    indices: torch.Tensor
    """(total_q_blocks, num_kv_heads, max_k_blocks) int32."""
    scores: torch.Tensor | None = None
    """(total_q_blocks, num_kv_heads, max_k_blocks) float32: estimated share of the query block's
    attention mass per causal key block (rows sum to 1); None for an index built without a search."""

    @property
    def num_kv_heads(self) -> int:
        return self.counts.shape[1]

    def to_mask(self) -> torch.Tensor:
        """(total_q_blocks, num_kv_heads, max_k_blocks) bool mask of kept blocks."""
        n = self.indices.shape[-1]
        valid = torch.arange(n, device=self.counts.device) < self.counts.unsqueeze(-1).long()
        columns = torch.where(valid, self.indices.long(), n)  # unused slots land in a spare column
        mask = torch.zeros(*self.indices.shape[:-1], n + 1, dtype=torch.bool, device=self.counts.device)
        mask.scatter_(-1, columns, True)
        return mask[..., :n]

    def density(self) -> float:
        """Kept blocks over causal blocks, over all KV heads."""
        causal = self.layout.causal_blocks() * self.num_kv_heads
        return float(self.counts.long().sum().item()) / max(causal, 1)

    @classmethod
    def from_mask(cls, layout: BatchLayout, mask: torch.Tensor) -> "BlockIndex":
        """An index from a (total_q_blocks, num_kv_heads, max_k_blocks) bool mask.

        The mask is clipped to causal blocks and the diagonal block is added: every query needs it.
        """
        n = mask.shape[-1]
        cols = torch.arange(n, device=mask.device)
        diag = layout.qblock_pos.to(mask.device).long().view(-1, 1, 1)
        mask = (mask.bool() & (cols <= diag)) | (cols == diag)
        counts = mask.sum(-1).to(torch.int32)
        indices = torch.where(mask, cols, cols + n).argsort(dim=-1).to(torch.int32)  # kept first, ascending
        return cls(layout=layout, counts=counts, indices=indices)
