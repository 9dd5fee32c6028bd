# SPDX-License-Identifier: Apache-2.0
"""prefill-accel adapter: the V1 scheduler's requests as the runtime's step planner sees them.

The planner (``prefill_accel.engine.planner.StepPlanner``, shared with the other engines) decides: the
partial-prefill limits (``--max-num-partial-prefills``, ``--max-long-partial-prefills``,
``--long-prefill-token-threshold``, which V1 defines but never enforced), decodes first (the running
decodes' tokens come off the step's budget before any prefill chunk is sized) and the step latency
target (``--max-step-latency-ms``: each chunk charged its own cost by a step-time model fitted online,
``prefill_accel.scheduling``). This module turns requests into its views and passes its answers back;
the patched scheduler calls it once per step and once per prefill chunk, and nothing here calls the
scheduler.

A step's wall time runs from its schedule() to its update_from_output(), started no earlier than the
previous update_from_output(): with a batch queue (async scheduling) a step starts running when the
one before it finished, not when it was scheduled.
"""

import time
from collections.abc import Callable, Iterable

from prefill_accel.engine.planner import PlannerOptions, Scheduled, StepPlanner
from prefill_accel.scheduling.prefills import Chunk

from vllm.config import SchedulerConfig
from vllm.v1.request import Request


def remaining_prefill_tokens(request: Request) -> int:
    """Tokens the request still has to compute before it can decode (prompt, or prompt and earlier
    outputs for a preempted request)."""
    return max(request.num_tokens - request.num_computed_tokens, 0)


def chunk(request: Request) -> Chunk:
    return Chunk(remaining=remaining_prefill_tokens(request), context=request.num_computed_tokens)


def decode_tokens(request: Request, step: int) -> int:
    """Tokens a running decode asks for in scheduler step `step` (1, plus speculative tokens; 0 while
    pipeline-parallel decode pacing holds it back)."""
    if step < request.next_decode_eligible_step:
        return 0
    return max(request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens, 0)


class PrefillPlanner:
    """The scheduler's one object of prefill-accel planning: `begin_step` once per `schedule()`,
    `admission` before taking a waiting request, `cap` on every prefill chunk's size, `consume` once the
    chunk is scheduled, `end_step` when the step is complete and `observe_output` when its output comes."""

    ADMIT, SKIP, STOP = StepPlanner.ADMIT, StepPlanner.SKIP, StepPlanner.STOP

    def __init__(self, scheduler_config: SchedulerConfig, max_num_scheduled_tokens: int, max_model_len: int,
                 block_size: int, clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.planner = StepPlanner(
            scheduler_config.max_num_partial_prefills, scheduler_config.max_long_partial_prefills,
            scheduler_config.long_prefill_token_threshold, scheduler_config.max_step_latency_ms,
            max_num_scheduled_tokens, max_model_len, min_prefill_tokens=block_size,
            options=PlannerOptions(bound_tokens=True, cap_long_chunks=False, refuse_chunks=True), clock=clock,
        )  # fmt: skip

    @property
    def clock(self) -> Callable[[], float]:
        return self.planner.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:  # a simulation runs the scheduler on its own time
        self.planner.clock = clock

    def begin_step(self, running: list[Request], waiting_queues: Iterable[Iterable[Request]], token_budget: int,
                   step: int) -> int:  # fmt: skip
        decodes = [Scheduled(r.num_computed_tokens, decode_tokens(r, step), prefill=False)
                   for r in running if not r.is_prefill_chunk]  # fmt: skip
        prefilling = [chunk(r) for r in running if r.is_prefill_chunk]
        waiting = (chunk(request) for queue in waiting_queues for request in queue)
        return self.planner.begin_step(decodes, prefilling, waiting, token_budget)

    def admission(self, request: Request) -> str:
        return self.planner.admission(chunk(request))

    def cap(self, request: Request, num_new_tokens: int) -> int:
        return self.planner.cap(chunk(request), num_new_tokens)

    def consume(self, request: Request, num_tokens: int, admitted: bool) -> None:
        """Before the scheduler advances the request's computed tokens."""
        self.planner.consume(chunk(request), num_tokens, admitted)

    def end_step(self, scheduler_output: object, requests: dict[str, Request]) -> None:
        """Before the scheduler advances the computed tokens of the step's requests."""
        scheduled = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            prefill = request.num_computed_tokens < request.num_prompt_tokens
            scheduled.append(Scheduled(request.num_computed_tokens, n, prefill))
        self.planner.end_step(scheduler_output, scheduled)

    def observe_output(self, scheduler_output: object) -> None:
        self.planner.observe(scheduler_output)
