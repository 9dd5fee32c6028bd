"""Which prefills a step runs and how much of each: the max-min fair share of the step's prefill
budget (tokens or seconds), the waiting prefills a step takes whole beside a partial one, the
partial-prefill limits (admission, long slots) over :class:`Chunk` views of the engine's prefills,
and the shortest-remaining-prefill-first key with aging (``--prefill-order srpf``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


def water_level(demands: list, budget):
    """Largest per-prefill cap L with sum(min(d, L) for d in demands) <= budget (tokens as
    ints, or seconds as floats).

    With enough budget for every demand, L is the whole budget: nobody is capped. (Not the largest
    demand: demands in seconds are predictions, and a level at a prediction of zero, as a fit that
    has not yet priced prefill tokens makes, would refuse every chunk.)
    """
    if not demands:
        return budget
    left, count = budget, len(demands)
    for demand in sorted(demands):
        if demand * count > left:
            return left / count if isinstance(left, float) else left // count
        left -= demand
        count -= 1
    return budget


def whole_beside(partial_remaining: int, demands: Iterable[int], budget: int) -> int:
    """How many of ``demands`` (waiting prefills, in the order they are to be admitted) a step of
    ``budget`` tokens takes whole beside a partial prefill with ``partial_remaining`` tokens left, for
    engines that cannot chunk a second prefill beside a partial one (SGLang): the max-min fair share,
    with no prefill cut. Each is admitted while the partial prefill keeps at least the largest admitted
    demand (its fair share under the water level), or all it has left when that is less, and at least
    one token; the first that does not fit ends the admission."""
    admitted, total, largest = 0, 0, 0
    for demand in demands:
        total, largest = total + demand, max(largest, demand)
        if budget - total < max(min(partial_remaining, largest), 1):
            break
        admitted += 1
    return admitted


@dataclass(frozen=True)
class Chunk:
    """A prefill as the policies see it: the prompt tokens it has left, and the context (tokens already
    computed) its next chunk attends to. Engines' adapters make these of their requests."""

    remaining: int
    context: int = 0


class PartialPrefills:
    """``--max-num-partial-prefills N`` (on when N > 1), ``--max-long-partial-prefills`` and
    ``--long-prefill-token-threshold`` for one step, over prefills given as :class:`Chunk` views.

    Admission: at most N requests prefill at once (running chunks plus those admitted this step),
    at most ``max_long`` of them long (more than ``long_threshold`` tokens left); a long request
    that finds the long slots taken is skipped so a shorter one behind it starts. Sharing: the
    step's prefill tokens (and, under a latency target, its prefill time) are split max-min fairly
    over the prefills expected this step, each asking for at most ``long_threshold`` tokens.
    """

    ADMIT, SKIP, STOP = "admit", "skip", "stop"

    def __init__(self, max_partial: int, max_long: int, long_threshold: int) -> None:
        self.max_partial, self.max_long, self.long_threshold = max_partial, max_long, long_threshold
        self.enabled = max_partial > 1
        self._count = 0
        self._long_count = 0

    def is_long(self, chunk: Chunk) -> bool:
        return 0 < self.long_threshold < chunk.remaining

    def demand(self, chunk: Chunk) -> int:
        """Tokens the prefill asks of a step: what it has left, at most the long threshold."""
        return self.long_threshold if self.is_long(chunk) else max(chunk.remaining, 0)

    def shares(self, prefilling: list[Chunk], waiting: Iterable[Chunk], tokens: int,
               chunk_seconds: Callable[[Chunk, int], float] | None = None,
               seconds: float = 0.0) -> tuple[int, float | None]:  # fmt: skip
        """Start a step with these running prefills; return the water levels of its tokens and (with
        ``chunk_seconds``) of its ``seconds`` over the prefills expected this step: the running ones
        and the waiting ones, in queue order, that admission would take."""
        self._count = len(prefilling)
        self._long_count = sum(self.is_long(c) for c in prefilling)
        expected = list(prefilling)
        free, free_long = self.max_partial - self._count, self.max_long - self._long_count
        for chunk in waiting:
            if free <= 0:
                break
            if self.is_long(chunk):
                if free_long <= 0:
                    continue
                free_long -= 1
            free -= 1
            expected.append(chunk)
        demands = [self.demand(c) for c in expected]
        level = water_level(demands, tokens)
        if chunk_seconds is None:
            return level, None
        return level, water_level([chunk_seconds(c, min(d, level)) for c, d in zip(expected, demands)], seconds)

    def admission(self, chunk: Chunk) -> str:
        """ADMIT, SKIP (a long request while the long slots are taken) or STOP (no slot left)."""
        if not self.enabled:
            return self.ADMIT
        if self._count >= self.max_partial:
            return self.STOP
        if self.is_long(chunk) and self._long_count >= self.max_long:
            return self.SKIP
        return self.ADMIT

    def admitted(self, chunk: Chunk) -> None:
        """Count a request taken from waiting this step."""
        if self.enabled:
            self._count += 1
            self._long_count += self.is_long(chunk)


def aged_remaining(remaining_tokens: int, waited_s: float, aging_s: float) -> float:
    """SRPF key with aging: remaining prefill tokens scaled by ``1 - waited / aging_s`` (floored at
    0), so precedence rises linearly with waiting and every request that waited ``aging_s`` sorts
    first."""
    return max(remaining_tokens, 0) * max(1.0 - max(waited_s, 0.0) / aging_s, 0.0)
