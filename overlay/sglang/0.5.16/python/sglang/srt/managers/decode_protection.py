"""Decode protection for SGLang's prefill-first scheduler: a bound on consecutive prefill batches.

Placed by the prefill-accel overlay. SGLang runs a prefill batch whenever one can be formed, so a
long prompt cut into chunks (chunked prefill) or a steady stream of new requests keeps the running
decodes waiting, batch after batch (sgl-project/sglang#32549). With
``--max-consecutive-prefill-batches N``, after N prefill batches in a row while decodes were waiting,
the scheduler runs one decode batch before it forms the next prefill batch, so the decodes advance
at least once every N + 1 batches. The held-back prefill (a chunked request included) resumes in the
next batch, unchanged. Without the flag the scheduler is upstream's.
"""

from typing import Optional

FLAG = "--max-consecutive-prefill-batches"


def decodes_waiting(running_batch) -> bool:
    """Whether the running batch holds requests that decode (not a prefill-only batch)."""
    return not running_batch.is_empty() and not running_batch.is_prefill_only


class PrefillStreak:
    """Prefill batches run in a row while decodes waited, and whether the next one must wait."""

    def __init__(self, max_consecutive: Optional[int]):
        if max_consecutive is not None and max_consecutive < 1:
            raise ValueError(
                f"{FLAG} must be at least 1 (prefill batches in a row before a decode batch), "
                f"got {max_consecutive}; leave it unset to keep SGLang's prefill-first order"
            )
        self.max_consecutive = max_consecutive
        self.length = 0

    def holds_prefill(self, running_batch) -> bool:
        """True when the bound is reached and decodes wait: this round runs a decode batch."""
        return (
            self.max_consecutive is not None
            and self.length >= self.max_consecutive
            and decodes_waiting(running_batch)
        )

    def record(self, batch, running_batch) -> None:
        """Account the batch the scheduler chose to run (None when idle)."""
        if batch is None:
            return
        if batch.forward_mode.is_decode():
            self.length = 0
        elif batch.forward_mode.is_extend() and not batch.forward_mode.is_mixed():
            # A mixed batch carries the decodes along; only a pure prefill makes them wait.
            self.length = self.length + 1 if decodes_waiting(running_batch) else 0
