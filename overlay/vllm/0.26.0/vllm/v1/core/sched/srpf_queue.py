# SPDX-License-Identifier: Apache-2.0
"""Shortest-remaining-prefill-first waiting queue with aging (prefill-accel).

`--prefill-order srpf` admits waiting requests by how many tokens they still have to prefill,
fewest first, so a short chat request is not queued behind a 128K-token document. Aging
bounds the wait: a request's sort key is its remaining prefill tokens scaled by
`1 - waited / prefill_aging_s`, so its precedence rises linearly with waiting time and every
request that has waited `prefill_aging_s` seconds sorts at 0, ahead of anything that waited
less, first come first served among themselves. No request waits much longer than
`prefill_aging_s` plus the service time of requests that aged out before it.

With `--scheduling-policy priority`, requests are ordered by priority first and by the SRPF
key within a priority level; the aging never overrides an explicit priority. The key is the runtime's
(`prefill_accel.engine.planner.srpf_key`); this module is the queue V1's scheduler pops from.

Remaining tokens are counted before the prefix cache is consulted (`num_tokens -
num_computed_tokens`); waiting time runs from the request's arrival, so a preempted request
resumes ahead of younger ones.
"""

import time
from collections.abc import Callable, Iterable, Iterator

from prefill_accel.engine.planner import srpf_key

from vllm.config import SchedulerConfig
from vllm.v1.core.sched.prefill_planner import remaining_prefill_tokens
from vllm.v1.core.sched.request_queue import (
    RequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from vllm.v1.request import Request

# Keys are re-evaluated when the queue changes, or when the clock moved by this fraction of
# the aging bound since the last ordering: a key is then stale by at most 1% of its size.
RESORT_FRACTION = 0.01


class ShortestRemainingPrefillQueue(RequestQueue):
    """Waiting requests ordered by (priority,) aged remaining prefill tokens, arrival, id."""

    def __init__(
        self,
        aging_s: float,
        by_priority: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.aging_s = aging_s
        self.by_priority = by_priority
        # Request.arrival_time is wall-clock time (time.time()).
        self.clock = clock
        self._requests: list[Request] = []
        # _requests sorted by key at _ordered_at, highest precedence last; None when stale.
        self._order: list[Request] | None = None
        self._ordered_at = 0.0
        # The head the last peek returned; a pop right after it returns the same request.
        self._peeked: Request | None = None

    def key(self, request: Request, now: float) -> tuple:
        return srpf_key(remaining_prefill_tokens(request), now - request.arrival_time, self.aging_s,
                        request.arrival_time, request.priority if self.by_priority else None, request.request_id)

    def _ordered(self, allow_stale: bool = False) -> list[Request]:
        now = self.clock()
        if self._order is None or (
            not allow_stale and now - self._ordered_at > RESORT_FRACTION * self.aging_s
        ):
            self._order = sorted(
                self._requests, key=lambda r: self.key(r, now), reverse=True
            )
            self._ordered_at = now
        return self._order

    def _changed(self) -> None:
        self._order = None
        self._peeked = None

    def add_request(self, request: Request) -> None:
        self._requests.append(request)
        self._changed()

    def pop_request(self) -> Request:
        if not self._requests:
            raise IndexError("pop from an empty queue")
        # The scheduler peeks, then pops: pop what the peek saw, even if time moved on.
        request = self._ordered(allow_stale=self._peeked is not None).pop()
        self._peeked = None
        self._requests.remove(request)
        return request

    def peek_request(self) -> Request:
        if not self._requests:
            raise IndexError("peek from an empty queue")
        self._peeked = self._ordered()[-1]
        return self._peeked

    def prepend_request(self, request: Request) -> None:
        """Ordering is by key; there is no front to prepend to."""
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self._requests.remove(request)
        self._changed()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = requests if isinstance(requests, set) else set(requests)
        self._requests = [r for r in self._requests if r not in to_remove]
        self._changed()

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(reversed(list(self._ordered())))


def create_waiting_queue(
    policy: SchedulingPolicy, scheduler_config: SchedulerConfig
) -> RequestQueue:
    """The waiting queue for `policy`, ordered shortest-remaining-prefill-first with
    aging when `scheduler_config.prefill_order` is "srpf"."""
    if scheduler_config.prefill_order != "srpf":
        return create_request_queue(policy)
    return ShortestRemainingPrefillQueue(
        aging_s=scheduler_config.prefill_aging_s,
        by_priority=policy == SchedulingPolicy.PRIORITY,
    )


def select_waiting_queue(
    waiting: RequestQueue, skipped_waiting: RequestQueue
) -> RequestQueue | None:
    """Of the scheduler's two SRPF queues, the one whose head goes first."""
    if waiting and skipped_waiting:
        assert isinstance(waiting, ShortestRemainingPrefillQueue)
        now = waiting.clock()
        head, skipped_head = waiting.peek_request(), skipped_waiting.peek_request()
        if waiting.key(head, now) <= waiting.key(skipped_head, now):
            return waiting
        return skipped_waiting
    return waiting or skipped_waiting or None
