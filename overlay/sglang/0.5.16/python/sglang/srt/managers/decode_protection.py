"""prefill-accel adapter: decode protection for SGLang's prefill-first scheduler.

Placed by the prefill-accel overlay. SGLang runs a prefill batch whenever one can be formed, so a
long prompt cut into chunks (chunked prefill) or a steady stream of new requests keeps the running
decodes waiting, batch after batch (sgl-project/sglang#32549). With
``--max-consecutive-prefill-batches N``, after N prefill batches in a row while decodes were waiting,
the scheduler runs one decode batch before it forms the next prefill batch, so the decodes advance
at least once every N + 1 batches. The held-back prefill (a chunked request included) resumes in the
next batch, unchanged. Without the flag the scheduler is upstream's. The counting is the runtime's
(``prefill_accel.engine.planner.PrefillStreak``); this module reads SGLang's batches for it.
"""

from typing import Optional

from prefill_accel.engine import planner


def decodes_waiting(running_batch) -> bool:
    """Whether the running batch holds requests that decode (not a prefill-only batch)."""
    return not running_batch.is_empty() and not running_batch.is_prefill_only


def batch_kind(batch) -> Optional[str]:
    """What the runtime's streak counts of the batch the scheduler chose (None when idle)."""
    if batch is None:
        return None
    if batch.forward_mode.is_decode():
        return "decode"
    if batch.forward_mode.is_extend() and not batch.forward_mode.is_mixed():
        return "prefill"
    return "mixed"


class PrefillStreak:
    """The scheduler's streak of prefill batches, over SGLang's batches."""

    def __init__(self, max_consecutive: Optional[int]):
        self.streak = planner.PrefillStreak(max_consecutive)

    @property
    def length(self) -> int:
        return self.streak.length

    def holds_prefill(self, running_batch) -> bool:
        return self.streak.holds_prefill(decodes_waiting(running_batch))

    def record(self, batch, running_batch) -> None:
        self.streak.record(batch_kind(batch), decodes_waiting(running_batch))
