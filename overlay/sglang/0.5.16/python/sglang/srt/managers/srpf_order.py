"""Shortest-remaining-prefill-first order of SGLang's waiting queue, with aging (prefill-accel).

Placed by the prefill-accel overlay; selected with ``--schedule-policy srpf``. The waiting requests
are ordered by the tokens they still have to prefill, fewest first, so a short chat request is not
queued behind a 128K-token document. Aging bounds the wait: the key is the remaining tokens scaled
by ``1 - waited / --prefill-aging-s`` (at least 0), so precedence rises linearly with waiting time
and a request that has waited ``--prefill-aging-s`` seconds goes ahead of anything younger, first
come first served among those. With ``--enable-priority-scheduling`` the priority decides first and
this order applies within a priority level. The same policy and aging flag as the vLLM series; the
key is ``prefill_accel.engine.planner.srpf_key``.

SchedulePolicy sorts the queue before every prefill batch. A request's prefix found in the radix cache
counts as done from the scheduler's last look-up of it (when it was last considered for a batch; an
unmatched new request counts its whole prompt): srpf, like fcfs, does not match the whole queue
against the cache each time. Waiting time runs from the request's latest entry into the queue.
"""

import time
from typing import List

from prefill_accel.engine.planner import srpf_key

# The time base of SchedulerReqTimeStats.wait_queue_entry_time.
clock = time.perf_counter


def remaining_prefill_tokens(req) -> int:
    """Tokens the request still has to prefill: its input (and, once retracted, its output so far)
    less the prefix last matched in the cache."""
    return len(req.origin_input_ids) + len(req.output_ids) - req.num_matched_prefix_tokens


def sort_by_remaining_prefill(
    waiting_queue: List, aging_s: float, by_priority: bool, priority_sign: int
) -> None:
    """Sort the queue in place, highest precedence first (stable, so ties keep their order).

    ``priority_sign`` is SchedulePolicy's: -1 when higher priority values go first, 1 when lower do.
    """
    now = clock()

    def key(req) -> tuple:
        entered = req.time_stats.wait_queue_entry_time
        return srpf_key(remaining_prefill_tokens(req), now - entered if entered else 0.0, aging_s, entered,
                        req.priority * priority_sign if by_priority else None)

    waiting_queue.sort(key=key)
