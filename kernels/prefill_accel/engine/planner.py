"""The step planner every patched scheduler calls, in one direction: which prefills a step admits and how
many tokens each chunk gets, under the partial-prefill limits, decode-first and a step latency target.

A patched scheduler calls, per step: ``begin_step`` with views of its decodes, running prefills and
waiting queue (it returns the tokens the prefills may use), then for each prefill ``admission`` (a
waiting one), ``cap`` (the chunk's size) and ``consume`` (once scheduled), then ``end_step`` with what
the step holds, and ``observe`` when that step's output arrives. The planner never calls back into the
engine: the adapter (overlay/<engine>/<version>/) builds the views and applies the answers. The policies
themselves are prefill_accel.scheduling's.

What differs between engines is said by PlannerOptions, not by subclasses.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..scheduling.prefills import Chunk, PartialPrefills, aged_remaining
from ..scheduling.step_budget import PrefillTime
from ..scheduling.step_time import STEP_FEATURES, attention_pairs

# Scheduled steps waiting for their output; more than the deepest batch queue in use.
MAX_IN_FLIGHT_STEPS = 8


@dataclass(frozen=True)
class Scheduled:
    """What one request of a step does: ``tokens`` after ``context`` computed tokens; ``prefill`` when
    they are prompt tokens (a decode's are its next token and any speculative ones)."""

    context: int
    tokens: int
    prefill: bool


@dataclass(frozen=True)
class PlannerOptions:
    """How an engine's scheduler differs, decided by its adapter."""

    bound_tokens: bool = True
    """The planner keeps the step's prefill tokens (the budget less the decodes) and caps chunks by what
    is left (vLLM V1, whose loops do not reserve decodes); False where the engine's own budget does."""
    cap_long_chunks: bool = False
    """Cut every chunk at --long-prefill-token-threshold (engines whose scheduler does not itself)."""
    refuse_chunks: bool = True
    """A chunk whose context read alone does not fit the step's time gets nothing; False gives it
    ``min_prefill_tokens`` instead (vLLM V0's running loop stops at the first group given none, which
    would hold back every decode behind it)."""
    decodes_in_step: bool = True
    """The running decodes run in the step that carries the prefill chunks (vLLM; SGLang's mixed chunks):
    their tokens and predicted time come off the step's. False where a prefill batch runs instead of the
    decodes (SGLang, prefill first): they wait for it, so it is timed while they run, but its time and
    tokens are its prefills' alone."""
    time_for_waiting: bool = False
    """Prefills are also timed while nothing decodes but more than one prefill wants the step: where a
    waiting request joins a partial prefill's batch whole and gets its first token only when that batch
    ends (SGLang under srpf), the batch is what it waits for."""


class StepPlanner:
    """One scheduler's prefill planning, step by step (see the module docstring)."""

    ADMIT, SKIP, STOP = PartialPrefills.ADMIT, PartialPrefills.SKIP, PartialPrefills.STOP

    def __init__(self, max_partial: int, max_long: int, long_threshold: int, max_step_latency_ms: float | None,
                 token_scale: int, max_model_len: int, min_prefill_tokens: int, options: PlannerOptions = PlannerOptions(),
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.limits = PartialPrefills(max_partial, max_long, long_threshold)
        self.time = PrefillTime(max_step_latency_ms, token_scale, max_model_len, min_prefill_tokens)
        self.options = options
        self.clock = clock
        self._tokens_left = 0
        self._level: int | None = None
        self._seconds_level: float | None = None
        self._step_start = 0.0
        self._in_flight: deque[tuple[object, dict[str, int], float]] = deque(maxlen=MAX_IN_FLIGHT_STEPS)
        self._last_output_at = -math.inf

    @property
    def timed(self) -> bool:
        """Whether this step's prefills are sized to the latency target (a target, someone waiting for the
        step, a fitted model)."""
        return self.time.seconds_left is not None

    def begin_step(self, decodes: Iterable[Scheduled], prefilling: list[Chunk], waiting: Iterable[Chunk],
                   token_budget: int) -> int:  # fmt: skip
        """Start a step of ``token_budget`` tokens: the decodes are served first, so the prefills get the
        rest, returned; with a target their time is what the decodes leave (while decodes run, or with
        ``time_for_waiting`` while other prefills wait), and with the limits on both are shared max-min
        fairly over the prefills expected this step. Decodes not in the step (``decodes_in_step`` off)
        leave it all its tokens and time, but it is timed while they wait."""
        self._step_start = self.clock()
        decode_tokens = decode_pairs = 0
        for decode in decodes:
            decode_tokens += decode.tokens
            decode_pairs += attention_pairs(decode.context, decode.tokens)
        others_waiting = bool(decode_tokens)
        if self.options.time_for_waiting and not others_waiting:
            waiting = iter(waiting)
            first = list(itertools.islice(waiting, max(2 - len(prefilling), 0)))
            others_waiting = len(prefilling) + len(first) > 1
            waiting = itertools.chain(first, waiting)
        if not self.options.decodes_in_step:
            decode_tokens = decode_pairs = 0
        self.time.start(decode_tokens, decode_pairs, others_waiting)
        self._tokens_left = max(token_budget - decode_tokens, 0)
        self._level = self._seconds_level = None
        if self.limits.enabled:
            self._level, self._seconds_level = self.limits.shares(
                prefilling, waiting, self._tokens_left,
                self._chunk_seconds if self.timed else None, self.time.prefill_seconds if self.timed else 0.0,
            )  # fmt: skip
        return self._tokens_left

    def _chunk_seconds(self, chunk: Chunk, tokens: int) -> float:
        return self.time.model.chunk_seconds(tokens, chunk.context)

    def admission(self, chunk: Chunk) -> str:
        """ADMIT, SKIP (a long prefill while the long slots are taken) or STOP (no slot, or no prefill
        tokens left in this step)."""
        if self.options.bound_tokens and self._tokens_left <= 0:
            return self.STOP
        return self.limits.admission(chunk)

    def cap(self, chunk: Chunk, num_new_tokens: int, block: int = 0) -> int:
        """The size allowed for a chunk of ``chunk`` that asks for ``num_new_tokens``; with ``block`` (prefix
        caching on an engine that wants it) a cut chunk is a whole number of blocks, at least one."""
        allowed = min(num_new_tokens, self._tokens_left) if self.options.bound_tokens else num_new_tokens
        if self.options.cap_long_chunks and self.limits.long_threshold > 0:
            allowed = min(allowed, self.limits.long_threshold)
        if self._level is not None:
            allowed = min(allowed, max(self._level, 1))
        if self.timed:
            wanted = allowed
            allowed = self.time.limit_tokens(chunk.context, allowed, self._seconds_level, floor_each=self.limits.enabled)
            if not self.options.refuse_chunks:
                allowed = allowed or min(wanted, self.time.min_prefill_tokens)
        if block and allowed < num_new_tokens:
            allowed = min(max(allowed // block, 1) * block, num_new_tokens)
        return allowed

    def cap_whole(self, chunk: Chunk, num_new_tokens: int) -> int:
        """The size allowed for a chunk the engine cannot cut this step (whole or nothing): SGLang holds one
        chunked request at a time, so a request that goes ahead of another's chunk under srpf cannot be
        chunked while that one holds the slot. Where the step's time allows it whole, whole; where the
        target would cut it and it is the step's first prefill, whole all the same: the alternative is not
        a smaller chunk but waiting outside the step for as long as the other request holds the slot, a
        long document's every remaining chunk (SGLang run 6, docs/sglang-0.5.md: chats waited 237-430 ms
        beside a 98K-token document while one decoded). Such a step runs over the target by one request's
        prefill. A later one in the same step waits for the next step; 0 is nothing."""
        allowed = self.cap(chunk, num_new_tokens)
        if allowed >= num_new_tokens:
            return num_new_tokens
        if self.timed and self.time.granted_tokens == 0:
            self.time.stats.whole += 1
            return num_new_tokens
        return 0

    def consume(self, chunk: Chunk, num_tokens: int, admitted: bool) -> None:
        """Record a scheduled chunk (before the engine advances its computed tokens); ``admitted`` for a
        prefill taken from waiting this step."""
        self._tokens_left = max(self._tokens_left - num_tokens, 0)
        if self.timed:
            self.time.charge(chunk.context, num_tokens)
        if admitted:
            self.limits.admitted(chunk)

    def end_step(self, step: object, scheduled: Iterable[Scheduled]) -> None:
        """Remember what the scheduled step ``step`` (any object naming it) holds, to fit its wall time
        when `observe` says its output came."""
        features = dict.fromkeys(STEP_FEATURES, 0)
        for item in scheduled:
            pairs = attention_pairs(item.context, item.tokens)
            if item.prefill:
                features["prefill_tokens"] += item.tokens
                features["prefill_pairs"] += pairs
                features["prefill_keys"] += item.context
            else:
                features["decode_tokens"] += item.tokens
                features["decode_pairs"] += pairs
        if features["decode_tokens"] or features["prefill_tokens"]:
            self._in_flight.append((step, features, self._step_start))

    def observe(self, step: object) -> None:
        """The output of step ``step`` arrived: fit the model with its wall time, from its start (or the
        previous output, if later: with a batch queue a step runs once the one before it finished)."""
        now = self.clock()
        for i, (key, features, started) in enumerate(self._in_flight):
            if key is step:
                del self._in_flight[i]
                self.time.model.observe(now - max(started, self._last_output_at), **features)
                break
        self._last_output_at = now


def srpf_key(remaining: int, waited_s: float, aging_s: float, arrival, priority=None, tiebreak=None) -> tuple:
    """The order of a waiting request under --prefill-order srpf, lowest first: (its priority, where the
    engine orders by priority,) its remaining prefill tokens aged by the ``waited_s`` it has waited, then
    its arrival, then a tiebreak the engine gives (a request id)."""
    key = (aged_remaining(remaining, waited_s, aging_s), arrival)
    if tiebreak is not None:
        key += (tiebreak,)
    return key if priority is None else (priority, *key)


class PrefillStreak:
    """--max-consecutive-prefill-batches for a prefill-first scheduler: after ``max_consecutive`` prefill
    batches in a row while decodes waited, the next batch decodes (None: no bound, the engine's order)."""

    def __init__(self, max_consecutive: int | None, flag: str = "--max-consecutive-prefill-batches") -> None:
        if max_consecutive is not None and max_consecutive < 1:
            raise ValueError(
                f"{flag} must be at least 1 (prefill batches in a row before a decode batch), "
                f"got {max_consecutive}; leave it unset to keep the engine's prefill-first order"
            )
        self.max_consecutive = max_consecutive
        self.length = 0

    def holds_prefill(self, decodes_waiting: bool) -> bool:
        """True when the bound is reached and decodes wait: this round runs a decode batch."""
        return self.max_consecutive is not None and self.length >= self.max_consecutive and decodes_waiting

    def record(self, ran: str | None, decodes_waiting: bool) -> None:
        """Account the batch the scheduler chose: ``"decode"``, ``"prefill"`` (prefill only), anything else
        (a mixed batch carries the decodes along) or None (idle)."""
        if ran == "decode":
            self.length = 0
        elif ran == "prefill":
            self.length = self.length + 1 if decodes_waiting else 0
