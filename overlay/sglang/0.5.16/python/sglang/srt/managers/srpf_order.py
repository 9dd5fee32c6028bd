"""Shortest-remaining-prefill-first order of SGLang's waiting queue, with aging (prefill-accel).

Placed by the prefill-accel overlay; selected with ``--schedule-policy srpf``. The waiting requests
are ordered by the tokens they still have to prefill, fewest first, so a short chat request is not
queued behind a 128K-token document. Aging bounds the wait: the key is the remaining tokens scaled
by ``1 - waited / --prefill-aging-s`` (at least 0), so precedence rises linearly with waiting time
and a request that has waited ``--prefill-aging-s`` seconds goes ahead of anything younger, first
come first served among those. With ``--enable-priority-scheduling`` the priority decides first and
this order applies within a priority level. The same policy and aging flag as the vLLM series; the
key is ``prefill_accel.engine.planner.srpf_key``.

While a request is prefilled chunk by chunk, SGLang puts its next chunk first in every prefill batch, so a
chat that arrives during a long document would wait for the document's last chunk whatever the order.
Under srpf the waiting requests with less to prefill go before the chunk instead, whole, as many as keep
the chunk at its max-min fair share of the batch (prefill_accel.scheduling.prefills.whole_beside), and
the chunk takes the rest (add_chunk_after_shorter, called by the scheduler in place of add_chunked_req).

SchedulePolicy sorts the queue before every prefill batch. A request's prefix found in the radix cache
counts as done from the scheduler's last look-up of it (when it was last considered for a batch; an
unmatched new request counts its whole prompt): srpf, like fcfs, does not match the whole queue
against the cache each time. Waiting time runs from the request's latest entry into the queue.
"""

import time
from typing import List, Optional, Tuple

from prefill_accel.engine.planner import srpf_key
from prefill_accel.scheduling.prefills import whole_beside

from sglang.srt.runtime_context import get_server_args

# The time base of SchedulerReqTimeStats.wait_queue_entry_time.
clock = time.perf_counter


def remaining_prefill_tokens(req) -> int:
    """Tokens the request still has to prefill: its input (and, once retracted, its output so far)
    less the prefix last matched in the cache."""
    return len(req.origin_input_ids) + len(req.output_ids) - req.num_matched_prefix_tokens


def _key(req, remaining: int, now: float, aging_s: float, by_priority: bool, priority_sign: int) -> tuple:
    entered = req.time_stats.wait_queue_entry_time
    return srpf_key(remaining, now - entered if entered else 0.0, aging_s, entered,
                    req.priority * priority_sign if by_priority else None)


def sort_by_remaining_prefill(
    waiting_queue: List, aging_s: float, by_priority: bool, priority_sign: int
) -> None:
    """Sort the queue in place, highest precedence first (stable, so ties keep their order).

    ``priority_sign`` is SchedulePolicy's: -1 when higher priority values go first, 1 when lower do.
    """
    now = clock()
    waiting_queue.sort(key=lambda req: _key(req, remaining_prefill_tokens(req), now, aging_s, by_priority,
                                            priority_sign))  # fmt: skip


def add_chunk_after_shorter(adder, policy, waiting_queue: List, chunked_req, tree_cache, max_requests: int,
                            truncation_align_size: Optional[int], srpf_first: bool,
                            step_latency) -> Tuple[Optional[object], List]:  # fmt: skip
    """The chunked request's next chunk in a prefill batch (PrefillAdder.add_chunked_req): under srpf,
    with ``srpf_first`` (the scheduler's features allow it), after the waiting requests whose key precedes
    the chunked request's and that go beside it whole at its fair share, at most ``max_requests`` in the
    batch; otherwise first and alone, as SGLang does. The queue is in srpf order already. Every request goes
    in through ``step_latency`` (step_latency.StepLatency: under --max-step-latency-ms each is also charged
    its time, the first whole even where the target would cut it, since it cannot be chunked beside the
    chunked request, and the chunk gets the time left). Returns what add_chunked_req returns (the request while
    unfinished) and the requests admitted before it."""
    from sglang.srt.managers.schedule_policy import AddReqResult, CacheAgnosticPolicy  # it imports this module

    ahead = []
    if srpf_first and policy.policy == CacheAgnosticPolicy.SRPF and adder.rem_chunk_tokens:
        args, now = get_server_args(), clock()
        remaining = len(chunked_req.full_untruncated_fill_ids) - len(chunked_req.prefix_indices)
        keyed = dict(aging_s=args.prefill_aging_s, by_priority=policy.enable_priority_scheduling,
                     priority_sign=policy.priority_sign)  # fmt: skip
        chunk_key = _key(chunked_req, remaining, now, **keyed)
        candidates = []
        for req in waiting_queue:
            if len(candidates) >= max_requests - len(adder.can_run_list) - 1:
                break
            if _key(req, remaining_prefill_tokens(req), now, **keyed) >= chunk_key:
                break
            req.init_next_round_input(tree_cache)
            candidates.append(req)
        demands = [len(req.full_untruncated_fill_ids) - len(req.prefix_indices) for req in candidates]
        for req in candidates[: whole_beside(remaining, demands, adder.rem_chunk_tokens)]:
            result = step_latency.add_one_req(adder, req, has_chunked_req=True,
                                              truncation_align_size=truncation_align_size, ahead_of_chunk=True)  # fmt: skip
            if req in adder.can_run_list:
                ahead.append(req)
            if result != AddReqResult.CONTINUE:
                break
    return step_latency.add_chunked_req(adder, chunked_req), ahead
