"""Shortest-remaining-prefill-first order of the V0 waiting queue, with aging (prefill-accel).

`--prefill-order srpf` puts the waiting requests in order of the tokens they still have to
prefill, fewest first, so a short chat request is not queued behind a 128K-token document. Aging
bounds the wait: the key is the remaining tokens scaled by `1 - waited / prefill_aging_s` (at
least 0), so precedence rises linearly with waiting time and a request that has waited
`prefill_aging_s` seconds goes ahead of anything younger, first come first served among those.
With `--scheduling-policy priority` the key orders requests within a priority level. The same
policy and flags as the vLLM 0.26.0 series; the key is `prefill_accel.engine.planner.srpf_key`.

The scheduler reorders its waiting deque at the start of every step; remaining tokens are counted
before the prefix cache is consulted, waiting time from the request's arrival.
"""

import time
from collections import deque
from typing import Deque, Iterable, Optional

from prefill_accel.engine.planner import srpf_key

from vllm.core.prefill_planner import remaining_prefill_tokens
from vllm.sequence import SequenceGroup

# Wall-clock seconds, the time base of SequenceGroup.arrival_time; a simulation on simulated
# time replaces it (scripts/simulate_prefill_scheduling.py --engine v0).
clock = time.time


def srpf_ordered(waiting: Iterable[SequenceGroup],
                 aging_s: float,
                 by_priority: bool,
                 now: Optional[float] = None) -> Deque[SequenceGroup]:
    """The waiting groups, highest precedence first (a stable sort)."""
    now = clock() if now is None else now

    def key(seq_group: SequenceGroup) -> tuple:
        return srpf_key(remaining_prefill_tokens(seq_group),
                        now - seq_group.arrival_time, aging_s,
                        seq_group.arrival_time,
                        seq_group.priority if by_priority else None)

    return deque(sorted(waiting, key=key))
