"""prefill-accel adapter: the V0 scheduler's sequence groups as the runtime's step planner sees them.

The planner (``prefill_accel.engine.planner.StepPlanner``, the one the vLLM 0.26.0 series uses) decides,
with the same flags and semantics: the partial-prefill limits (``--max-num-partial-prefills``,
``--max-long-partial-prefills``, ``--long-prefill-token-threshold``, which also caps every chunk here)
and the step latency target (``--max-step-latency-ms``). What V0 needs differently is said by its
options: V0's own token budget bounds the step (decodes already come first in its chunked-prefill
policy), it does not cap chunks at the long threshold itself, and a chunk is never refused outright
(V0's running loop stops at the first group that gets no tokens, which would hold back the decodes
behind it, so every chunk keeps one KV block); under prefix caching a cut chunk is whole blocks.

Timing: the V0 engine runs one step after another while requests run, so a step's wall time is the time
from its `schedule()` to the next one; a step is observed only when requests were still running at the
next `schedule()`, which excludes idle time after the last request finished.
"""

import time
from typing import Callable, Iterable, List, Optional, Tuple

from prefill_accel.engine.planner import PlannerOptions, Scheduled, StepPlanner
from prefill_accel.scheduling.prefills import Chunk

from vllm.config import CacheConfig, SchedulerConfig
from vllm.sequence import SequenceGroup, SequenceStatus


def remaining_prefill_tokens(seq_group: SequenceGroup) -> int:
    """Tokens the group's prompt still has to compute (0 once it decodes)."""
    if not seq_group.is_prefill():
        return 0
    return sum(seq.get_num_new_tokens() for seq in seq_group.get_seqs()
               if not seq.is_finished())


def computed_tokens(seq_group: SequenceGroup) -> int:
    """The context a prefill chunk of the group attends to besides itself."""
    return seq_group.get_seqs()[0].data.get_num_computed_tokens()


def chunk(seq_group: SequenceGroup) -> Chunk:
    return Chunk(remaining=remaining_prefill_tokens(seq_group),
                 context=computed_tokens(seq_group))


def decodes(seq_group: SequenceGroup) -> List[Scheduled]:
    """One token for each running sequence of a decoding group."""
    return [
        Scheduled(seq.get_len() - 1, 1, prefill=False)
        for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING)
    ]


class PrefillPlanner:
    """The scheduler's one object of prefill-accel planning: `begin_step` once per scheduling step,
    `admission` before taking a waiting group, `cap` on every prefill chunk's size, `consume` once the
    chunk is scheduled, `end_step` with what the step holds."""

    ADMIT, SKIP, STOP = StepPlanner.ADMIT, StepPlanner.SKIP, StepPlanner.STOP

    def __init__(self,
                 scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.block_size = cache_config.block_size
        self.planner = StepPlanner(
            scheduler_config.max_num_partial_prefills,
            scheduler_config.max_long_partial_prefills,
            scheduler_config.long_prefill_token_threshold,
            scheduler_config.max_step_latency_ms,
            scheduler_config.max_num_batched_tokens,
            scheduler_config.max_model_len,
            min_prefill_tokens=cache_config.block_size,
            options=PlannerOptions(bound_tokens=False,
                                   cap_long_chunks=True,
                                   refuse_chunks=False),
            clock=clock)
        # The last scheduled step, observed at the next one while requests run.
        self._last: Optional[object] = None

    @property
    def clock(self) -> Callable[[], float]:
        return self.planner.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.planner.clock = clock

    def begin_step(self, running: Iterable[SequenceGroup],
                   waiting: Iterable[SequenceGroup],
                   token_budget: int) -> None:
        """Observe the previous step, then start this one."""
        running = list(running)
        if self._last is not None and running:
            self.planner.observe(self._last)
        self._last = None
        self.planner.begin_step(
            [d for g in running if not g.is_prefill() for d in decodes(g)],
            [chunk(g) for g in running if g.is_prefill()],
            (chunk(g) for g in waiting), token_budget)

    def admission(self, seq_group: SequenceGroup) -> str:
        return self.planner.admission(chunk(seq_group))

    def cap(self, seq_group: SequenceGroup, num_new_tokens: int,
            aligned: bool) -> int:
        """With `aligned` (prefix caching) a cut chunk is a whole number of blocks, at least one."""
        return self.planner.cap(chunk(seq_group), num_new_tokens,
                                self.block_size if aligned else 0)

    def consume(self, seq_group: SequenceGroup, num_tokens: int,
                admitted: bool) -> None:
        self.planner.consume(chunk(seq_group), num_tokens, admitted)

    def end_step(self, scheduled: List[Tuple[SequenceGroup, int]]) -> None:
        """Remember what the step holds ((group, tokens) pairs) to fit its time at the next step."""
        items: List[Scheduled] = []
        for seq_group, num_tokens in scheduled:
            if seq_group.is_prefill():
                items.append(
                    Scheduled(computed_tokens(seq_group), num_tokens, True))
            else:
                items += decodes(seq_group)
        if items:
            self._last = object()
            self.planner.end_step(self._last, items)
