"""Engine-agnostic pieces of prefill-accel's scheduling policies, shared by the engine overlays.

Pure Python, no engine types: the overlay modules of each engine (vLLM 0.26.0 V1, vLLM 0.6.3 V0)
adapt their requests to these functions.

* :func:`water_level`: the max-min fair share of a step's prefill budget (tokens or seconds), and
  :class:`PartialPrefills`, the partial-prefill limits (admission, long slots, the step's shares).
* :func:`attention_pairs` and :class:`StepTimeModel`: the online model of a step's wall time,
  ``c0 + c1 * tokens + c2 * attention_pairs + c3 * prefill_keys``, and :class:`PrefillTime`, the
  step's prefill time under ``--max-step-latency-ms`` spent chunk by chunk.
* :func:`aged_remaining`: the shortest-remaining-prefill-first key with aging (``--prefill-order srpf``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import TypeVar

Request = TypeVar("Request")

# Weight of older steps per new step: ~20 steps of memory, quick enough to follow a prefill
# whose context grows every step, long enough to average out step-to-step noise.
FORGETTING = 0.95
# Steps observed before the model may cap prefills (three coefficients need a few points).
WARMUP_STEPS = 4
# Ridge weight relative to the data, keeps the solve defined while a feature has not varied.
RIDGE = 1e-9


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


class PartialPrefills:
    """``--max-num-partial-prefills N`` (on when N > 1), ``--max-long-partial-prefills`` and
    ``--long-prefill-token-threshold`` for one step, over an engine's requests through the number
    of prefill tokens each has left (``remaining``).

    Admission: at most N requests prefill at once (running chunks plus those admitted this step),
    at most ``max_long`` of them long (more than ``long_threshold`` tokens left); a long request
    that finds the long slots taken is skipped so a shorter one behind it starts. Sharing: the
    step's prefill tokens (and, under a latency target, its prefill time) are split max-min fairly
    over the prefills expected this step, each asking for at most ``long_threshold`` tokens.
    """

    ADMIT, SKIP, STOP = "admit", "skip", "stop"

    def __init__(self, max_partial: int, max_long: int, long_threshold: int,
                 remaining: Callable[[Request], int]) -> None:  # fmt: skip
        self.max_partial, self.max_long, self.long_threshold = max_partial, max_long, long_threshold
        self.remaining = remaining
        self.enabled = max_partial > 1
        self._count = 0
        self._long_count = 0

    def is_long(self, request: Request) -> bool:
        return 0 < self.long_threshold < self.remaining(request)

    def demand(self, request: Request) -> int:
        """Tokens the request asks of a step: what it has left, at most the long threshold."""
        remaining = self.remaining(request)
        return self.long_threshold if 0 < self.long_threshold < remaining else remaining

    def shares(self, prefilling: list[Request], waiting: Iterable[Request], tokens: int,
               chunk_seconds: Callable[[Request, int], float] | None = None,
               seconds: float = 0.0) -> tuple[int, float | None]:  # fmt: skip
        """Start a step with these running prefills; return the water levels of its tokens and (with
        ``chunk_seconds``) of its ``seconds`` over the prefills expected this step: the running ones
        and the waiting ones, in queue order, that admission would take."""
        self._count = len(prefilling)
        self._long_count = sum(self.is_long(r) for r in prefilling)
        expected = list(prefilling)
        free, free_long = self.max_partial - self._count, self.max_long - self._long_count
        for request in waiting:
            if free <= 0:
                break
            if self.is_long(request):
                if free_long <= 0:
                    continue
                free_long -= 1
            free -= 1
            expected.append(request)
        demands = [self.demand(r) for r in expected]
        level = water_level(demands, tokens)
        if chunk_seconds is None:
            return level, None
        return level, water_level([chunk_seconds(r, min(d, level)) for r, d in zip(expected, demands)], seconds)

    def admission(self, request: Request) -> str:
        """ADMIT, SKIP (a long request while the long slots are taken) or STOP (no slot left)."""
        if not self.enabled:
            return self.ADMIT
        if self._count >= self.max_partial:
            return self.STOP
        if self.is_long(request) and self._long_count >= self.max_long:
            return self.SKIP
        return self.ADMIT

    def admitted(self, request: Request) -> None:
        """Count a request taken from waiting this step."""
        if self.enabled:
            self._count += 1
            self._long_count += self.is_long(request)


def attention_pairs(num_computed_tokens: int, num_new_tokens: int) -> int:
    """Query-key pairs of a chunk of num_new_tokens after num_computed_tokens (causal)."""
    q = num_new_tokens
    return q * num_computed_tokens + q * (q + 1) // 2


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a small dense system."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if a[col][col] == 0.0:
            continue
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        if a[r][r] != 0.0:
            x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


class StepTimeModel:
    """Online fit of step seconds = c0 + c1 * tokens + c2 * attention_pairs + c3 * prefill_keys.

    ``prefill_keys`` is the context the step's prefill chunks read before their own tokens (each
    chunk its request's computed tokens): a chunk of a few queries at a long context costs about
    what reading that context costs, because prefill attention kernels parallelise over query tiles
    and heads, not over keys (decodes get split-KV kernels, so their keys count as pairs). Without
    this term, the cost of small chunks late in a long prompt lands in c0 and the model overstates
    the time of every step, decodes alone included. Fresh prompts read no context, so the term
    stays apart from the token term and is learnt from continuation chunks only.
    """

    FEATURES = 4

    def __init__(self, token_scale: float, pair_scale: float, key_scale: float | None = None) -> None:
        # Features are scaled to ~[0, 1] so the ridge term means the same for each; pair_scale is
        # token_scale times the longest context, which is also the scale of the keys read.
        key_scale = pair_scale / token_scale if key_scale is None else key_scale
        self._scales = (1.0, float(token_scale), float(pair_scale), float(key_scale))
        self._xtx = [[0.0] * self.FEATURES for _ in range(self.FEATURES)]
        self._xty = [0.0] * self.FEATURES
        self.num_observations = 0
        self.coefficients = (0.0,) * self.FEATURES

    def observe(self, tokens: int, pairs: int, seconds: float, prefill_keys: int = 0) -> None:
        x = [1.0, tokens / self._scales[1], pairs / self._scales[2], prefill_keys / self._scales[3]]
        for i in range(self.FEATURES):
            self._xty[i] = FORGETTING * self._xty[i] + x[i] * seconds
            for j in range(self.FEATURES):
                self._xtx[i][j] = FORGETTING * self._xtx[i][j] + x[i] * x[j]
        self.num_observations += 1
        self.coefficients = self._fit()

    def _fit(self) -> tuple[float, ...]:
        """Least squares with non-negative coefficients (active set over the features)."""
        active = list(range(self.FEATURES))
        while active:
            ridge = RIDGE * max(self._xtx[i][i] for i in range(self.FEATURES))
            sub = [[self._xtx[i][j] + (ridge if i == j else 0.0) for j in active] for i in active]
            solution = _solve(sub, [self._xty[i] for i in active])
            negative = [i for i, v in zip(active, solution) if v < 0.0]
            if not negative:
                scaled = dict(zip(active, solution))
                return tuple(scaled.get(i, 0.0) / self._scales[i] for i in range(self.FEATURES))
            active.remove(min(negative, key=lambda i: solution[active.index(i)]))
        return (0.0,) * self.FEATURES

    @property
    def ready(self) -> bool:
        return self.num_observations >= WARMUP_STEPS

    def predict(self, tokens: float, pairs: float, prefill_keys: float = 0.0) -> float:
        c0, c1, c2, c3 = self.coefficients
        return c0 + c1 * tokens + c2 * pairs + c3 * prefill_keys

    def chunk_seconds(self, num_tokens: int, context: int) -> float:
        """Predicted time a prefill chunk of num_tokens after `context` computed tokens adds to a step."""
        if num_tokens <= 0:
            return 0.0
        _, c1, c2, c3 = self.coefficients
        return c1 * num_tokens + c2 * attention_pairs(context, num_tokens) + c3 * context

    def max_chunk(self, seconds: float, context: int) -> int | None:
        """Largest chunk x at `context` computed tokens with chunk_seconds(x, context) <= seconds;
        None when unbounded (no cost learnt). Solves
        c2/2 x^2 + (c1 + c2 (context + 1/2)) x + c3 context <= seconds.
        """
        _, c1, c2, c3 = self.coefficients
        seconds -= c3 * context
        if seconds <= 0.0:
            return 0
        a, b = c2 / 2.0, c1 + c2 * (context + 0.5)
        if a > 0.0:
            return int((-b + math.sqrt(b * b + 4.0 * a * seconds)) / (2.0 * a))
        if b > 0.0:
            return int(seconds / b)
        return None


def aged_remaining(remaining_tokens: int, waited_s: float, aging_s: float) -> float:
    """SRPF key with aging: remaining prefill tokens scaled by ``1 - waited / aging_s`` (floored at
    0), so precedence rises linearly with waiting and every request that waited ``aging_s`` sorts
    first."""
    return max(remaining_tokens, 0) * max(1.0 - max(waited_s, 0.0) / aging_s, 0.0)


# Consecutive steps whose decodes alone exceed the target before that is reported.
UNREACHABLE_STEPS = 100
# Consecutive steps in which every prefill chunk was refused (its context alone costs more than the
# time the decodes leave) before one step lets prefill chunks through uncapped: at most one step in
# this many runs over the target, fewer than 1%, and a long prompt still moves while decodes run.
STARVATION_STEPS = 128

logger = logging.getLogger(__name__)
# PREFILL_ACCEL_BUDGET_STATS=N: every N timed steps, one INFO line on how the target capped prefills.
BUDGET_STATS_ENV = "PREFILL_ACCEL_BUDGET_STATS"


class PrefillTime:
    """A step's prefill time under a latency target, spent chunk by chunk, each chunk charged its own
    cost (its tokens and their attention over its own context) by the fitted :class:`StepTimeModel`.

    The engines' step-time budgets build on this: they time steps and feed `model`, call `start`
    with the step's decodes, and size each prefill chunk with `limit_tokens` and `charge`.

    A chunk too costly for the time left is cut, down to nothing when even reading its context does
    not fit: a chunk of a few tokens late in a long prompt costs a whole step of attention for
    little progress. Two exceptions keep prefills moving. When the decodes alone exceed the target
    (set too low), prefill chunks still get ``min_prefill_tokens``; and after `STARVATION_STEPS`
    steps in which prefill chunks were refused outright, one step takes them uncapped.
    """

    def __init__(self, max_step_latency_ms: float | None, token_scale: int, max_model_len: int,
                 min_prefill_tokens: int) -> None:
        self.target_s = None if max_step_latency_ms is None else max_step_latency_ms / 1e3
        self.min_prefill_tokens = min_prefill_tokens
        self.model = StepTimeModel(token_scale=token_scale, pair_scale=float(token_scale) * max_model_len)
        self.seconds_left: float | None = None
        """Prefill time left in this step under the target; None when prefills are not timed."""
        self._prefill_granted = 0
        self._refused = False
        self._starved_steps = 0
        self._steps_over_target = 0
        self._warned = False
        self.stats = BudgetStats.from_env()

    def start(self, decode_tokens: int, decode_pairs: int) -> None:
        """A new step carrying these decodes: with a target and a fitted model, prefills get the time
        the decodes leave within it; without decodes (nobody's latency at stake) they are not timed."""
        self._starved_steps = self._starved_steps + 1 if self._refused and not self._prefill_granted else 0
        self.seconds_left = None
        self._prefill_granted = 0
        self._refused = False
        if self.target_s is None or not decode_tokens or not self.model.ready:
            return
        self.seconds_left = self.target_s - self.model.predict(decode_tokens, decode_pairs)
        self.stats.step(self.seconds_left, self.model.coefficients)
        self._steps_over_target = self._steps_over_target + 1 if self.seconds_left <= 0.0 else 0
        if self._steps_over_target == UNREACHABLE_STEPS and not self._warned:
            self._warned = True
            logger.warning(
                "--max-step-latency-ms %.1f is below the predicted time of the running decodes alone "
                "(%.1f ms over %d steps); prefills get only %d tokens per request per step. Raise the target.",
                self.target_s * 1e3, (self.target_s - self.seconds_left) * 1e3, UNREACHABLE_STEPS,
                self.min_prefill_tokens,
            )

    def limit_tokens(self, context: int, num_new_tokens: int, seconds: float | None = None,
                     floor_each: bool = False) -> int:
        """How much of a prefill chunk of num_new_tokens after `context` computed tokens fits the step's
        time left (or `seconds`, a share of it).

        The exceptions of the class docstring apply to the step's first prefill chunk, or with
        `floor_each` to every prefill chunk (the caller bounds how many there are).
        """
        if self.seconds_left is None or num_new_tokens <= 0:
            return num_new_tokens
        available = self.seconds_left if seconds is None else min(seconds, self.seconds_left)
        allowed = self.model.max_chunk(available, context)
        if allowed is None:
            return num_new_tokens
        if floor_each or self._prefill_granted == 0:
            if self._starved_steps >= STARVATION_STEPS:
                self.stats.released += 1
                return num_new_tokens
            if self.seconds_left <= 0.0:
                allowed = max(allowed, self.min_prefill_tokens)
                self.stats.floored += 1
        if allowed == 0:
            self._refused = True
        self.stats.chunk(num_new_tokens, min(num_new_tokens, allowed))
        return min(num_new_tokens, allowed)

    def charge(self, context: int, num_tokens: int) -> None:
        """Charge a scheduled prefill chunk to the step's time."""
        if self.seconds_left is None or num_tokens <= 0:
            return
        self.seconds_left -= self.model.chunk_seconds(num_tokens, context)
        self._prefill_granted += num_tokens


class BudgetStats:
    """What the step-latency target did to prefill chunks, logged every ``every`` timed steps (set
    PREFILL_ACCEL_BUDGET_STATS=N; on the engine's log, at INFO whatever the root logger's level).
    With ``every`` 0 (the variable unset) it only counts, a few integer additions per chunk."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._reset()

    def _reset(self) -> None:
        self.steps = self.chunks = self.capped = self.refused = self.floored = self.released = 0
        self.requested = self.granted = 0
        self.over_target = 0
        self.min_left_s = math.inf

    @classmethod
    def from_env(cls) -> "BudgetStats":
        value = os.environ.get(BUDGET_STATS_ENV, "")
        if not value:
            return cls(0)
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{BUDGET_STATS_ENV} must be a positive number of steps, got {value!r}")
        logger.setLevel(logging.INFO)
        if not logger.hasHandlers():
            logger.addHandler(logging.StreamHandler())
        return cls(int(value))

    def chunk(self, requested: int, granted: int) -> None:
        self.chunks += 1
        self.requested += requested
        self.granted += granted
        self.capped += granted < requested
        self.refused += granted == 0

    def step(self, seconds_left: float, coefficients: tuple[float, ...]) -> None:
        """Count a new timed step; once ``every`` steps are complete, first log them (their counts and
        the fitted model) and start over."""
        if self.every and self.steps == self.every:
            self._log(coefficients)
            self._reset()
        self.steps += 1
        self.over_target += seconds_left <= 0.0
        self.min_left_s = min(self.min_left_s, seconds_left)

    def _log(self, coefficients: tuple[float, ...]) -> None:
        c0, c1, c2, c3 = coefficients
        logger.info(
            "step-latency budget, last %d timed steps: %d prefill chunks, %d capped, %d refused, %d at the "
            "floor, %d starvation releases; %d of %d tokens granted; decodes over the target in %d steps, "
            "least prefill time left %.2f ms; model c0 %.3f ms, c1 %.3g ms/token, c2 %.3g ms/pair, c3 %.3g ms/key",
            self.steps, self.chunks, self.capped, self.refused, self.floored, self.released, self.granted,
            self.requested, self.over_target, self.min_left_s * 1e3, c0 * 1e3, c1 * 1e3, c2 * 1e3, c3 * 1e3,
        )  # fmt: skip
