"""Step latency target for the V0 chunked-prefill scheduler (prefill-accel).

`--max-step-latency-ms T` sizes the prefill chunks of a step that carries decodes so the
predicted step time stays within T, with the model and the per-chunk charge of the vLLM 0.26.0
series: a step costs what its decodes cost (fixed + per token + per attention pair) plus, when it
carries prefill chunks, a fixed cost and each chunk's tokens, attention pairs and context read,
fitted online (`prefill_accel.scheduling.StepTimeModel`); the time the decodes leave within T is
spent chunk by chunk, each chunk charged its own cost at its own request's context, so a chat
prompt next to a long document costs what a chat prompt costs. Decodes already come first in V0's chunked-prefill
policy (the running queue holds them ahead of running prefill chunks).

Timing: the V0 engine runs one step after another while requests run, so a step's wall time is the
time from its `schedule()` to the next one. A step is observed only when requests were still
running at the next `schedule()`, which excludes idle time after the last request finished.

Until the model has seen a few steps, or while no decode runs, prefills are not capped. Unlike on
0.26.0, a chunk whose context read alone does not fit is not refused: V0's running loop stops at the
first group that gets no tokens, which would hold back the decodes behind it, so every chunk keeps
one KV block. When the decodes alone exceed the target, a warning says the target is below what the
decodes take (`prefill_accel.scheduling.PrefillTime`).
"""

import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from prefill_accel.scheduling import STEP_FEATURES, PrefillTime, attention_pairs

from vllm.sequence import SequenceGroup, SequenceStatus



def computed_tokens(seq_group: SequenceGroup) -> int:
    """The context a prefill chunk of the group attends to besides itself."""
    return seq_group.get_seqs()[0].data.get_num_computed_tokens()


class StepTimeBudget(PrefillTime):
    """Times steps, fits the model and limits prefill chunks to the target."""

    def __init__(self,
                 max_step_latency_ms: Optional[float],
                 max_num_batched_tokens: int,
                 max_model_len: int,
                 min_prefill_tokens: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(max_step_latency_ms, max_num_batched_tokens,
                         max_model_len, min_prefill_tokens)
        self.clock = clock
        # (the step's features for StepTimeModel.observe, start) of the last scheduled step,
        # observed at the next schedule().
        self._last: Optional[Tuple[Dict[str, int], float]] = None
        self._step_start = 0.0

    def begin_step(self, running: Iterable[SequenceGroup]) -> None:
        """Observe the previous step, then set this step's prefill time: the target minus the
        predicted time of the running decodes."""
        now = self.clock()
        running = list(running)
        if self._last is not None and running:
            step, started = self._last
            self.model.observe(now - started, **step)
        self._last = None
        self._step_start = now
        decode_tokens = decode_pairs = 0
        for seq_group in running:
            if seq_group.is_prefill():
                continue
            for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
                decode_tokens += 1
                decode_pairs += seq.get_len()
        self.start(decode_tokens, decode_pairs)

    def chunk_seconds(self, seq_group: SequenceGroup, num_tokens: int) -> float:
        return self.model.chunk_seconds(num_tokens, computed_tokens(seq_group))

    def limit(self, seq_group: SequenceGroup, num_new_tokens: int,
              seconds: Optional[float], floor_each: bool) -> int:
        """The part of a prefill chunk that fits the step's time (PrefillTime.limit_tokens), at
        least `min_prefill_tokens`: V0's running loop stops at the first group given no tokens, so
        a refused chunk would hold back every decode queued behind it."""
        allowed = self.limit_tokens(computed_tokens(seq_group), num_new_tokens,
                                    seconds, floor_each)
        return allowed or min(num_new_tokens, self.min_prefill_tokens)

    def consume(self, seq_group: SequenceGroup, num_tokens: int) -> None:
        """Charge a scheduled prefill chunk to the step's time."""
        self.charge(computed_tokens(seq_group), num_tokens)

    def end_step(self, scheduled: List[Tuple[SequenceGroup, int]]) -> None:
        """Remember what the step holds ((group, tokens) pairs) to fit its time at the next step."""
        step = dict.fromkeys(STEP_FEATURES, 0)
        for seq_group, num_tokens in scheduled:
            if seq_group.is_prefill():
                context = computed_tokens(seq_group)
                step["prefill_tokens"] += num_tokens
                step["prefill_pairs"] += attention_pairs(context, num_tokens)
                step["prefill_keys"] += context
            else:
                for seq in seq_group.get_seqs(status=SequenceStatus.RUNNING):
                    step["decode_tokens"] += 1
                    step["decode_pairs"] += seq.get_len()
        if step["decode_tokens"] or step["prefill_tokens"]:
            self._last = (step, self._step_start)
