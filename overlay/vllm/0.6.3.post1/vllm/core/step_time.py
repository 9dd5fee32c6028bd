"""Step latency target for the V0 chunked-prefill scheduler (prefill-accel).

`--max-step-latency-ms T` sizes the prefill chunks of a step that carries decodes so the
predicted step time stays within T, with the model and the per-chunk charge of the vLLM 0.26.0
series: step seconds = c0 + c1 * tokens + c2 * attention pairs, fitted online
(`prefill_accel.scheduling.StepTimeModel`); the time the decodes leave within T is spent chunk by
chunk, each chunk charged its own cost at its own request's context, so a chat prompt next to a
long document costs what a chat prompt costs. Decodes already come first in V0's chunked-prefill
policy (the running queue holds them ahead of running prefill chunks).

Timing: the V0 engine runs one step after another while requests run, so a step's wall time is the
time from its `schedule()` to the next one. A step is observed only when requests were still
running at the next `schedule()`, which excludes idle time after the last request finished.

Until the model has seen a few steps, or while no decode runs, prefills are not capped. When the
decodes alone exceed the target, the step's first prefill chunk (each one with partial-prefill
limits) still gets one KV block, and a warning says the target is below what the decodes take.
"""

import time
from typing import Callable, Iterable, List, Optional, Tuple

from prefill_accel.scheduling import StepTimeModel, attention_pairs

from vllm.logger import init_logger
from vllm.sequence import SequenceGroup, SequenceStatus

# Consecutive steps whose decodes alone exceed the target before that is reported.
UNREACHABLE_STEPS = 100

logger = init_logger(__name__)


def computed_tokens(seq_group: SequenceGroup) -> int:
    """The context a prefill chunk of the group attends to besides itself."""
    return seq_group.get_seqs()[0].data.get_num_computed_tokens()


class StepTimeBudget:
    """Times steps, fits the model and limits prefill chunks to the target."""

    def __init__(self,
                 max_step_latency_ms: Optional[float],
                 max_num_batched_tokens: int,
                 max_model_len: int,
                 min_prefill_tokens: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.target_s = (None if max_step_latency_ms is None else
                         max_step_latency_ms / 1e3)
        self.min_prefill_tokens = min_prefill_tokens
        self.clock = clock
        self.model = StepTimeModel(
            token_scale=max_num_batched_tokens,
            pair_scale=float(max_num_batched_tokens) * max_model_len)
        # (tokens, pairs, start) of the last scheduled step, observed at the next schedule().
        self._last: Optional[Tuple[int, int, float]] = None
        self._seconds_left: Optional[float] = None
        self._prefill_granted = 0
        self._steps_over_target = 0
        self._warned = False

    def begin_step(self, running: Iterable[SequenceGroup]) -> None:
        """Observe the previous step, then set this step's prefill time: the target minus the
        predicted time of the running decodes."""
        now = self.clock()
        running = list(running)
        if self._last is not None and running:
            tokens, pairs, started = self._last
            self.model.observe(tokens, pairs, now - started)
        self._last = None
        self._step_start = now
        self._seconds_left = None
        self._prefill_granted = 0
        if self.target_s is None or not self.model.ready:
            return
        decode_tokens = decode_pairs = 0
        for seq_group in running:
            if seq_group.is_prefill():
                continue
            for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
                decode_tokens += 1
                decode_pairs += seq.get_len()
        if decode_tokens:
            self._seconds_left = self.target_s - self.model.predict(
                decode_tokens, decode_pairs)
            self._warn_if_target_unreachable()

    def _warn_if_target_unreachable(self) -> None:
        self._steps_over_target = (self._steps_over_target + 1
                                   if self._seconds_left <= 0.0 else 0)
        if self._steps_over_target == UNREACHABLE_STEPS and not self._warned:
            self._warned = True
            logger.warning(
                "--max-step-latency-ms %.1f is below the predicted time of "
                "the running decodes alone (%.1f ms over %d steps); prefills "
                "get only %d tokens per request per step. Raise the target.",
                self.target_s * 1e3,
                (self.target_s - self._seconds_left) * 1e3, UNREACHABLE_STEPS,
                self.min_prefill_tokens)

    @property
    def seconds_left(self) -> Optional[float]:
        """Prefill time left in this step under the target; None when prefills are not timed."""
        return self._seconds_left

    def chunk_seconds(self, seq_group: SequenceGroup, num_tokens: int) -> float:
        return self.model.chunk_seconds(num_tokens, computed_tokens(seq_group))

    def limit(self, seq_group: SequenceGroup, num_new_tokens: int,
              seconds: Optional[float], floor_each: bool) -> int:
        """How much of a prefill chunk fits the step's time left (or `seconds`, a share of it),
        charged at the group's own context; the step's first chunk (every chunk with
        `floor_each`) gets at least one block."""
        if self._seconds_left is None:
            return num_new_tokens
        available = (self._seconds_left if seconds is None else
                     min(seconds, self._seconds_left))
        allowed = self.model.max_chunk(available, computed_tokens(seq_group))
        if allowed is None:
            return num_new_tokens
        if floor_each or self._prefill_granted == 0:
            allowed = max(allowed, self.min_prefill_tokens)
        return min(num_new_tokens, allowed)

    def consume(self, seq_group: SequenceGroup, num_tokens: int) -> None:
        """Charge a scheduled prefill chunk to the step's time."""
        if self._seconds_left is None or num_tokens <= 0:
            return
        self._seconds_left -= self.chunk_seconds(seq_group, num_tokens)
        self._prefill_granted += num_tokens

    def end_step(self, scheduled: List[Tuple[SequenceGroup, int]]) -> None:
        """Remember what the step holds ((group, tokens) pairs) to fit its time at the next step."""
        tokens = pairs = 0
        for seq_group, num_tokens in scheduled:
            if seq_group.is_prefill():
                tokens += num_tokens
                pairs += attention_pairs(computed_tokens(seq_group),
                                         num_tokens)
            else:
                for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
                    tokens += 1
                    pairs += seq.get_len()
        if tokens:
            self._last = (tokens, pairs, self._step_start)
