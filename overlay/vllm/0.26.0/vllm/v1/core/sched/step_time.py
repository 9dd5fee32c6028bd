# SPDX-License-Identifier: Apache-2.0
"""Decode-first prefill budget and an online step-time model for a step latency target (prefill-accel).

Decodes first: the tokens every running decode asks for are taken off the step's token budget
before any prefill chunk is sized, so a long prefill earlier in the running list can no longer
push decodes out of a step.

Step latency target (`--max-step-latency-ms`): the scheduler never sees GPU time, so it learns
a cost model from the wall time of the steps it schedules and sizes prefill chunks so the
predicted step time stays within the target. The model of one step is what its decodes cost
plus, when it carries prefill chunks, what they add:

    t = d0 + d1 * Td + d2 * Pd  [ + p0 + p1 * Tp + p2 * Pp + p3 * K ]

    T  tokens scheduled in the step (d: decodes, p: prefill chunks): linear layers, sampling
    P  attention pairs: a chunk of q tokens after c computed tokens attends to
       q*c + q*(q+1)/2 keys; a decode (q = 1) reads its c + 1 keys
    K  context the prefill chunks read before their own tokens, c each: a few queries at a
       long context cost about that read, since prefill kernels split the work by queries
    d0 fixed cost per step (launches, CPU scheduling, sampling)
    p0 fixed cost of carrying any prefill chunk: a decode-only batch replays one full CUDA
       graph, a batch with a prefill chunk runs piecewise graphs with eager attention

The time the decodes leave within the target is spent chunk by chunk, the first chunk paying
p0, each its own cost, p1 * q + p2 * pairs over *its* request's context: a chat prompt that
arrives while a 128K document prefills costs what a chat prompt costs, not what a chunk at the
document's context would. With concurrent partial prefills (`prefill_budget.py`) the time is
shared max-min fairly among the step's prefills, so the document's chunk cannot use it all.

The quadratic attention term is what keeps the model honest on long prompts: for an 8B model
the attention FLOPs per token overtake the linear layers' beyond ~32K tokens of context, so
a per-token average learnt on early chunks of a 128K prompt underestimates the late ones
several times. Sparse attention lowers p2, which the fit picks up by itself.

The model lives in the runtime package (`prefill_accel.scheduling.StepTimeModel`, shared with the
other engines): two exponentially weighted least-squares fits (EWMAs of the normal equations)
with non-negative coefficients, one over decode-only steps and one over the prefill part of the
others (their time less the decodes' predicted part), each forgetting once per step of its kind.
A step's wall time is measured from its schedule() until its update_from_output(), started no
earlier than the previous update_from_output(): with a batch queue (async scheduling) a step
starts running when the one before it finished, not when it was scheduled. Until the model
has seen a few steps (`WARMUP_STEPS`), or while no decode is running (nobody's inter-token
latency is at stake), prefills are not capped by the target. A chunk whose context read alone
does not fit waits; after `STARVATION_STEPS` such steps one step takes it whole. When the
decodes alone are predicted to exceed the target, prefill chunks still get `min_prefill_tokens`
(the step's first one, or each one when partial-prefill limits bound their number) and a warning
says the target is below what the decodes alone take (`prefill_accel.scheduling.PrefillTime`).
"""

import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from prefill_accel.scheduling import STEP_FEATURES, PrefillTime, attention_pairs

from vllm.v1.request import Request

# Scheduled steps waiting for their output; more than the deepest batch queue in use.
MAX_IN_FLIGHT_STEPS = 8


def decode_tokens(request: Request, step: int) -> int:
    """Tokens a running decode asks for in scheduler step `step` (1, plus speculative
    tokens; 0 while pipeline-parallel decode pacing holds it back)."""
    if step < request.next_decode_eligible_step:
        return 0
    return max(
        request.num_tokens_with_spec
        + request.num_output_placeholders
        - request.num_computed_tokens,
        0,
    )


class StepTimeBudget(PrefillTime):
    """Decode-first prefill budget, optionally capped by a step latency target."""

    def __init__(
        self,
        max_step_latency_ms: float | None,
        max_num_scheduled_tokens: int,
        max_model_len: int,
        min_prefill_tokens: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(max_step_latency_ms, max_num_scheduled_tokens, max_model_len, min_prefill_tokens)
        self.clock = clock
        # (scheduler output, the step's features for StepTimeModel.observe, schedule() start) of steps
        # awaiting output.
        self._in_flight: deque[tuple[object, dict[str, int], float]] = deque(
            maxlen=MAX_IN_FLIGHT_STEPS
        )
        self._step_start = 0.0
        self._last_output_at = -math.inf

    def begin_step(self, running: Iterable[Request], token_budget: int, step: int) -> int:
        """Start timing a step; return the tokens its prefills may use.

        Running decodes are served first: their tokens are reserved off the budget. With a
        target, the time the decodes leave within it becomes the step's prefill time, spent
        through `limit` and `consume`.
        """
        self._step_start = self.clock()
        decode_tokens_total = pairs = 0
        for request in running:
            if request.is_prefill_chunk:
                continue
            n = decode_tokens(request, step)
            decode_tokens_total += n
            pairs += attention_pairs(request.num_computed_tokens, n)
        self.start(decode_tokens_total, pairs)
        return max(token_budget - decode_tokens_total, 0)

    def limit(
        self, request: Request, num_new_tokens: int, seconds: float | None = None, floor_each: bool = False
    ) -> int:
        """The part of a prefill chunk for `request` that fits the step's time (PrefillTime.limit_tokens)."""
        return self.limit_tokens(request.num_computed_tokens, num_new_tokens, seconds, floor_each)

    def chunk_seconds(self, request: Request, num_tokens: int) -> float:
        return self.model.chunk_seconds(num_tokens, request.num_computed_tokens)

    def consume(self, request: Request, num_tokens: int) -> None:
        """Charge a scheduled prefill chunk to the step's time (before num_computed_tokens moves)."""
        self.charge(request.num_computed_tokens, num_tokens)

    def end_step(self, scheduler_output: object, requests: dict[str, Request]) -> None:
        """Remember what a scheduled step holds, to fit its wall time when its output comes.

        Called before the scheduler advances num_computed_tokens for the step.
        """
        step = dict.fromkeys(STEP_FEATURES, 0)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            pairs = attention_pairs(request.num_computed_tokens, n)
            if request.num_computed_tokens < request.num_prompt_tokens:
                step["prefill_tokens"] += n
                step["prefill_pairs"] += pairs
                step["prefill_keys"] += request.num_computed_tokens
            else:
                step["decode_tokens"] += n
                step["decode_pairs"] += pairs
        if step["decode_tokens"] or step["prefill_tokens"]:
            self._in_flight.append((scheduler_output, step, self._step_start))

    def observe_output(self, scheduler_output: object) -> None:
        """Fit the model with the wall time of the step whose output just arrived."""
        now = self.clock()
        for i, (output, step, started) in enumerate(self._in_flight):
            if output is scheduler_output:
                del self._in_flight[i]
                self.model.observe(now - max(started, self._last_output_at), **step)
                break
        self._last_output_at = now
