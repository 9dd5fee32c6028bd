"""Per-step prefill token budget shared among concurrent partial prefills, V0 scheduler (prefill-accel).

With chunked prefill, vLLM 0.6.3's scheduler gives each prefill chunk what is left of the step's
token budget, in queue order: the first long prompt takes the whole step and a short prompt behind
it waits until it is done. With `--max-num-partial-prefills N` (N > 1) this module limits and
shares the budget, with the same semantics as the vLLM 0.26.0 series:

* Admission: at most N requests prefill at once (running prefill chunks plus those admitted this
  step), at most `--max-long-partial-prefills` of them long (more than
  `--long-prefill-token-threshold` tokens left); a long request that finds those slots taken is
  skipped, keeping its place, so a shorter one behind it starts.
* Sharing: the prefill tokens left after the running decodes are split max-min fairly (water
  filling) over the prefills expected in the step, so a short prompt finishes in one step while
  a long one takes the rest.
* `--long-prefill-token-threshold T` > 0 caps every prefill chunk at T tokens, with or without
  the limits.
* With a step latency target (`step_time.py`), each chunk also fits the step's prefill time,
  charged its own cost; with the limits on, the time is shared max-min fairly like the tokens.

The arithmetic is the runtime package's (`prefill_accel.scheduling`); this module adapts V0's
sequence groups to it.
"""

from typing import Iterable, Optional

from prefill_accel.scheduling import PartialPrefills

from vllm.config import SchedulerConfig
from vllm.core.step_time import StepTimeBudget
from vllm.sequence import SequenceGroup, SequenceStatus


def remaining_prefill_tokens(seq_group: SequenceGroup) -> int:
    """Tokens the group's prompt still has to compute (0 once it decodes)."""
    if not seq_group.is_prefill():
        return 0
    return sum(seq.get_num_new_tokens() for seq in seq_group.get_seqs()
               if not seq.is_finished())


class PrefillBudget:
    """Call `begin_step` once per scheduling step, `admission` before taking a waiting group,
    `cap` on every prefill chunk's size and `consume` once the chunk is scheduled."""

    ADMIT, SKIP, STOP = PartialPrefills.ADMIT, PartialPrefills.SKIP, PartialPrefills.STOP

    def __init__(self, scheduler_config: SchedulerConfig,
                 block_size: int) -> None:
        self.limits = PartialPrefills(
            scheduler_config.max_num_partial_prefills,
            scheduler_config.max_long_partial_prefills,
            scheduler_config.long_prefill_token_threshold,
            remaining_prefill_tokens)
        self.block_size = block_size
        self._level: Optional[int] = None
        self._limiter: Optional[StepTimeBudget] = None
        self._seconds_level: Optional[float] = None

    @property
    def limits_enabled(self) -> bool:
        return self.limits.enabled

    def begin_step(self,
                   running: Iterable[SequenceGroup],
                   waiting: Iterable[SequenceGroup],
                   token_budget: int,
                   limiter: Optional[StepTimeBudget] = None) -> None:
        """Start a step of `token_budget` tokens; decodes are served first, prefills share the
        rest, and the step's prefill time under `limiter`'s target when it has one."""
        self._level = None
        self._limiter = (limiter if limiter is not None
                         and limiter.seconds_left is not None else None)
        self._seconds_level = None
        if not self.limits_enabled:
            return
        prefilling, decode_tokens = [], 0
        for seq_group in running:
            if seq_group.is_prefill():
                prefilling.append(seq_group)
            else:
                decode_tokens += seq_group.num_seqs(status=SequenceStatus.RUNNING)
        self._level, self._seconds_level = self.limits.shares(
            prefilling, waiting, max(token_budget - decode_tokens, 0),
            None if self._limiter is None else self._limiter.chunk_seconds,
            0.0 if self._limiter is None else max(
                self._limiter.prefill_seconds, 0.0))

    def admission(self, seq_group: SequenceGroup) -> str:
        """ADMIT, SKIP (a long group while the long slots are taken) or STOP (no slot left)."""
        return self.limits.admission(seq_group)

    def cap(self, seq_group: SequenceGroup, num_new_tokens: int,
            aligned: bool) -> int:
        """The chunk size allowed for a prefill of `seq_group` asking for `num_new_tokens`; with
        `aligned` (prefix caching) a cut chunk is a whole number of blocks, at least one."""
        allowed = num_new_tokens
        if self.limits.long_threshold > 0:
            allowed = min(allowed, self.limits.long_threshold)
        if self._level is not None:
            allowed = min(allowed, max(self._level, 1))
        if self._limiter is not None:
            allowed = self._limiter.limit(seq_group, allowed,
                                          self._seconds_level,
                                          floor_each=self.limits_enabled)
        if aligned and allowed < num_new_tokens:
            allowed = max(allowed // self.block_size, 1) * self.block_size
            allowed = min(allowed, num_new_tokens)
        return allowed

    def consume(self, seq_group: SequenceGroup, num_tokens: int,
                admitted: bool) -> None:
        """Record a scheduled prefill chunk; `admitted` for a group taken from waiting."""
        if self._limiter is not None:
            self._limiter.consume(seq_group, num_tokens)
        if admitted:
            self.limits.admitted(seq_group)
