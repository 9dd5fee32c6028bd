# SPDX-License-Identifier: Apache-2.0
"""Per-step prefill token budget, shared among concurrent partial prefills (prefill-accel).

The V1 scheduler gives every prefill chunk `min(remaining prompt, token budget)`, in queue
order, so the first long prompt takes the whole step and everything behind it waits.
`SchedulerConfig` defines `max_num_partial_prefills` and `max_long_partial_prefills` but V1
never enforced them; this module does, for the scheduler's two loops:

* Admission: at most `max_num_partial_prefills` requests are prefilling at once (running
  prefill chunks plus those admitted this step), and at most `max_long_partial_prefills` of
  them are long, i.e. have more than `long_prefill_token_threshold` prompt tokens left. A
  long request that finds the long slots taken is skipped so a shorter one behind it can
  start (it keeps its place through the scheduler's skipped-waiting queue).
* Sharing: the step's prefill budget is split max-min fairly (water filling) over the
  prefills expected this step: every prefill gets at most the water level, so a short prompt
  is finished in one step while a long one takes the rest, never the whole budget while
  another prefill is waiting.

Limits apply when `max_num_partial_prefills > 1` (as in V0). In every mode the object also
enforces the step's total prefill budget given to `begin_step` (the scheduler passes what is
left after running decodes) and, with a step latency target, the step's prefill time
(`step_time.py`): each chunk is charged its own cost, and with limits on, the time is shared
max-min fairly like the tokens, so a long prompt's chunk cannot take it all either. The policy is
the runtime package's (`prefill_accel.scheduling.PartialPrefills`, shared with the V0 series).
"""

from collections.abc import Iterable

from prefill_accel.scheduling import PartialPrefills

from vllm.config import SchedulerConfig
from vllm.v1.core.sched.step_time import StepTimeBudget
from vllm.v1.request import Request


def remaining_prefill_tokens(request: Request) -> int:
    """Tokens the request still has to compute before it can decode (prompt, or prompt and
    earlier outputs for a preempted request)."""
    return max(request.num_tokens - request.num_computed_tokens, 0)


class PrefillBudget:
    """How many prefill tokens a step may schedule, and for which requests.

    Call `begin_step` once per `schedule()`, `admission` before taking a waiting request,
    `cap` on every prefill chunk's size and `consume` once the chunk is scheduled.
    """

    ADMIT, SKIP, STOP = PartialPrefills.ADMIT, PartialPrefills.SKIP, PartialPrefills.STOP

    def __init__(self, scheduler_config: SchedulerConfig) -> None:
        self.limits = PartialPrefills(
            scheduler_config.max_num_partial_prefills,
            scheduler_config.max_long_partial_prefills,
            scheduler_config.long_prefill_token_threshold,
            remaining_prefill_tokens,
        )
        self._tokens_left = 0
        self._level: int | None = None
        self._limiter: StepTimeBudget | None = None
        self._seconds_level: float | None = None

    @property
    def limits_enabled(self) -> bool:
        return self.limits.enabled

    def begin_step(
        self,
        running: Iterable[Request],
        waiting_queues: Iterable[Iterable[Request]],
        prefill_tokens: int,
        limiter: StepTimeBudget | None = None,
    ) -> None:
        """Start a step whose prefills may use at most `prefill_tokens` tokens in total, and the
        step's prefill time under `limiter`'s latency target when it has one."""
        self._tokens_left = max(prefill_tokens, 0)
        self._level = None
        self._limiter = limiter if limiter is not None and limiter.seconds_left is not None else None
        self._seconds_level = None
        if not self.limits_enabled:
            return
        waiting = (request for queue in waiting_queues for request in queue)
        self._level, self._seconds_level = self.limits.shares(
            [r for r in running if r.is_prefill_chunk],
            waiting,
            self._tokens_left,
            None if self._limiter is None else self._limiter.chunk_seconds,
            0.0 if self._limiter is None else max(self._limiter.prefill_seconds, 0.0),
        )

    def admission(self, request: Request) -> str:
        """ADMIT, SKIP (a long request while the long slots are taken) or STOP (no slot, or
        no prefill tokens left in this step)."""
        if self._tokens_left <= 0:
            return self.STOP
        return self.limits.admission(request)

    def cap(self, request: Request, num_new_tokens: int) -> int:
        """The prefill chunk size allowed for `request`, which asks for `num_new_tokens`."""
        allowed = min(num_new_tokens, self._tokens_left)
        if self._level is not None:
            allowed = min(allowed, max(self._level, 1))
        if self._limiter is not None:
            allowed = self._limiter.limit(request, allowed, self._seconds_level, floor_each=self.limits_enabled)
        return allowed

    def consume(self, request: Request, num_tokens: int, admitted: bool) -> None:
        """Record a scheduled prefill chunk; `admitted` for a request taken from waiting."""
        self._tokens_left = max(self._tokens_left - num_tokens, 0)
        if self._limiter is not None:
            self._limiter.consume(request, num_tokens)
        if admitted:
            self.limits.admitted(request)
