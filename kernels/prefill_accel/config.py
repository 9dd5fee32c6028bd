"""Configuration of block-sparse prefill attention: one validated dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SUPPORTED_BLOCK_SIZES = (64, 128, 256)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
"""Head sizes the Triton kernels take; others go to the dense fallback (the public functions)."""
ESTIMATORS = ("pooled", "bound", "mixed", "exact")
EXACT_ROWS = (1, 2, 4, 8)


@dataclass(frozen=True)
class SparsePrefillConfig:
    """How the block-importance search prunes key blocks.

    A sequence's keys and queries are cut into blocks of ``block_size`` absolute positions.
    For each query block and KV head the search estimates how much attention mass each
    causal key block receives and keeps a key block when its estimate is at least
    ``threshold`` times the largest estimate of that query block. ``threshold=0`` keeps every
    causal block, which is exact dense attention.

    The defaults are the ones measured in ``docs/accuracy.md``.
    """

    block_size: int = 128
    """Positions per query block and per key block (64, 128 or 256)."""
    threshold: float = 0.004
    """Max-relative keep threshold in [0, 1]; 0 keeps every causal block."""
    target_mass: float = 0.0
    """With a value in (0, 1], a query block also keeps its highest-estimate key blocks until they
    hold this share of its estimated attention (a mass-targeted cut); 0 disables it."""
    sink_blocks: int = 1
    """Key blocks at the start of the sequence that every query block keeps (attention sinks)."""
    local_blocks: int = 2
    """Key blocks just before the diagonal block that every query block keeps (local window)."""
    last_query_blocks: int = 1
    """The last query blocks of each sequence are computed dense (they shape the first output token)."""
    min_q_len: int = 24576
    """A sequence's step takes the sparse path once its context holds this many tokens and its queries
    bring at least the attention work of a fresh prompt half as long (see long_chunk); other steps are
    computed dense."""
    query_stride: int = 8
    """The pooled, bound and mixed estimates score every ``query_stride``-th query row of a block (1 scores all rows)."""
    estimator: str = "mixed"
    """How the search estimates a key block's share of a query block's attention: ``"pooled"``
    scores sampled query rows against each key block's mean key; ``"bound"`` against the upper
    bound of their logits over the block's keys, from its elementwise largest and smallest key
    (``q+ . max_key + q- . min_key``), which a single outstanding key lifts where a mean hides it;
    ``"mixed"`` averages those two estimates; ``"exact"`` takes the exact attention of ``exact_rows`` query rows per block (its last row
    among them) over every key."""
    exact_rows: int = 1
    """Query rows per block of the exact estimate (1, 2, 4 or 8, evenly spaced, the last row included)."""
    mean_correction: bool = False
    """Pruned key blocks fully visible to a query block contribute through their mean key and value."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            expected = bool if field.type in ("bool", bool) else None
            if expected is bool and not isinstance(value, bool):
                raise TypeError(f"SparsePrefillConfig.{field.name} must be a bool, got {value!r}")
            if field.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"SparsePrefillConfig.{field.name} must be an int, got {value!r}")
            if field.type in ("str", str) and not isinstance(value, str):
                raise TypeError(f"SparsePrefillConfig.{field.name} must be a string, got {value!r}")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"SparsePrefillConfig.block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size}"
            )
        for name in ("threshold", "target_mass"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SparsePrefillConfig.{name} must be a number, got {value!r}")
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"SparsePrefillConfig.{name} must lie in [0, 1], got {value}")
        for name in ("sink_blocks", "local_blocks", "last_query_blocks", "min_q_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"SparsePrefillConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.query_stride < 1 or self.block_size % self.query_stride:
            raise ValueError(
                f"SparsePrefillConfig.query_stride must be >= 1 and divide block_size={self.block_size}, "
                f"got {self.query_stride}"
            )
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"SparsePrefillConfig.estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if self.exact_rows not in EXACT_ROWS:
            raise ValueError(f"SparsePrefillConfig.exact_rows must be one of {EXACT_ROWS}, got {self.exact_rows}")
        if self.block_size // self.query_stride < 8:
            raise ValueError(
                f"SparsePrefillConfig.query_stride={self.query_stride} leaves fewer than 8 scored rows per "
                f"block of {self.block_size}; use a smaller stride"
            )

    def long_chunk(self, q_len: int, k_len: int | None = None) -> bool:
        """Whether a sequence with ``q_len`` queries in a step, over ``k_len`` keys in all (its
        context, these queries included; ``q_len`` when None, a fresh prompt), takes the sparse path.

        It does when its context holds at least ``min_q_len`` keys, where attention is sparse enough
        for the search to pay, and its causal attention work, ``q_len * k_len - q_len**2 / 2``
        query-key pairs, is at least a fresh prompt of ``min_q_len / 2`` tokens', which pays for the
        search's fixed cost. So a fresh prompt goes sparse from ``min_q_len`` tokens, and so does
        every chunk of a longer prompt from that context on (down to a few thousand queries there,
        fewer at longer contexts); the chunks before it stay dense, where the search keeps most
        blocks and FlashAttention is faster (per-chunk times in docs/e2e-vllm.md, run 13). A chunk
        shorter than a block (a decode step) stays dense unless ``min_q_len`` is shorter still.
        Every router (the engines' batch splits, the block layout, the dense route of the public
        function) asks this one question."""
        start = self.sparse_from(q_len)
        return start is not None and (q_len if k_len is None else k_len) >= start

    def sparse_from(self, q_len: int) -> int | None:
        """The shortest context (keys, these queries included) at which a chunk of ``q_len``
        queries takes the sparse path (see long_chunk): the least k >= max(q, min_q_len) with
        q*k - q**2/2 >= (min_q_len/2)**2/2; None where none does (no queries, or fewer than a block
        and than min_q_len)."""
        if q_len <= 0 or q_len < min(self.min_q_len, self.block_size):
            return None
        work = -(-(self.min_q_len * self.min_q_len + 4 * q_len * q_len) // (8 * q_len))
        return max(q_len, self.min_q_len, work)

    @property
    def is_dense(self) -> bool:
        """True when the configuration keeps every causal block (exact dense attention)."""
        return self.threshold == 0.0

    def replace(self, **changes) -> "SparsePrefillConfig":
        """A copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)
