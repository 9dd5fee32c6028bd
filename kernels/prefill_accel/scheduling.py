"""Engine-agnostic pieces of prefill-accel's scheduling policies, shared by the engine overlays.

Pure Python, no engine types: the step planner (prefill_accel.engine.planner), which every engine's
scheduler calls through its adapter, is made of these.

* :func:`water_level`: the max-min fair share of a step's prefill budget (tokens or seconds), and
  :class:`PartialPrefills`, the partial-prefill limits (admission, long slots, the step's shares), over
  :class:`Chunk` views of the engine's prefills.
* :func:`attention_pairs` and :class:`StepTimeModel`: the online model of a step's wall time, its
  decodes' cost plus what its prefill chunks add, and :class:`PrefillTime`, the step's prefill time
  under ``--max-step-latency-ms`` spent chunk by chunk.
* :func:`aged_remaining`: the shortest-remaining-prefill-first key with aging (``--prefill-order srpf``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# Weight of older steps per new step of the same kind: ~100 steps of memory. A prefill whose context
# grows every step is followed by the pair and key terms, not by forgetting; a memory of ~20 steps let
# noisy step times move the fitted fixed prefill cost several-fold (docs/scheduler.md, Simulation).
FORGETTING = 0.99
# Weight, in steps, of the prefill fit's prior that the fixed cost of a prefill step is zero. Under a
# latency target every step takes about the target, so its chunks are of about one size and the data
# cannot tell the fixed cost from the per-token cost; unanchored, one inconsistent step could put the
# whole cost on the fixed term and let a whole 8K chunk into a step several times over the target
# (simulated, docs/scheduler.md). With the prior such data charges per token, which prices small chunks
# low: they get scheduled, and their times separate the two. Varied chunk sizes outweigh it within a
# few steps.
PREFILL_STEP_PRIOR = 0.1
# Decode-only steps observed before the model may cap prefills (three coefficients need a few points).
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


class _DecayedFit:
    """Exponentially weighted least squares (an EWMA of the normal equations, forgetting once per
    observation) with non-negative coefficients, over features scaled to ~[0, 1] so the ridge term
    means the same for each; `prior` adds, per feature, that many steps' worth of evidence that its
    coefficient is zero (not forgotten)."""

    def __init__(self, scales: tuple[float, ...], prior: tuple[float, ...] | None = None) -> None:
        self._scales = scales
        self._prior = prior or (0.0,) * len(scales)
        n = len(scales)
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self.count = 0
        self.coefficients = (0.0,) * n

    def observe(self, features: tuple[float, ...], seconds: float) -> None:
        x = [f / s for f, s in zip(features, self._scales)]
        for i, xi in enumerate(x):
            self._xty[i] = FORGETTING * self._xty[i] + xi * seconds
            for j, xj in enumerate(x):
                self._xtx[i][j] = FORGETTING * self._xtx[i][j] + xi * xj
        self.count += 1
        self.coefficients = self._fit()

    def _fit(self) -> tuple[float, ...]:
        """Least squares with non-negative coefficients (active set over the features)."""
        n = len(self._scales)
        active = list(range(n))
        while active:
            ridge = RIDGE * max(self._xtx[i][i] for i in range(n))
            sub = [[self._xtx[i][j] + (ridge + self._prior[i] if i == j else 0.0) for j in active] for i in active]
            solution = _solve(sub, [self._xty[i] for i in active])
            negative = [i for i, v in zip(active, solution) if v < 0.0]
            if not negative:
                scaled = dict(zip(active, solution))
                return tuple(scaled.get(i, 0.0) / self._scales[i] for i in range(n))
            active.remove(min(negative, key=lambda i: solution[active.index(i)]))
        return (0.0,) * n

    def predict(self, features: tuple[float, ...]) -> float:
        return sum(c * f for c, f in zip(self.coefficients, features))


# What StepTimeModel.observe takes of a step besides its seconds (also the fields of a step trace).
STEP_FEATURES = ("decode_tokens", "decode_pairs", "prefill_tokens", "prefill_pairs", "prefill_keys")
# PREFILL_ACCEL_STEP_TRACE=FILE: one JSON line per timed step (appended, with the process id).
STEP_TRACE_ENV = "PREFILL_ACCEL_STEP_TRACE"


class StepTrace:
    """Every step the model is fed, as a JSON line: its measured seconds, its features, and what the
    model predicted for it before learning from it, so the step costs of an engine on a device can
    be studied (and the model's error measured) offline."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        path = os.environ.get(STEP_TRACE_ENV, "")
        return cls(path) if path else None

    def write(self, model: "StepTimeModel", seconds: float, **features: int) -> None:
        predicted = model.step_seconds(**features)
        record = {"pid": os.getpid(), "t": time.monotonic(), "seconds": seconds, "predicted": predicted, **features}
        self._file.write(json.dumps(record) + "\n")


class StepTimeModel:
    """Online model of a step's wall time: what its decodes cost, plus what its prefill chunks add.

        decodes   d0 + d1 * tokens + d2 * pairs                  fitted on steps without a prefill chunk
        prefills  p0 + p1 * tokens + p2 * pairs + p3 * keys      fitted on the rest of the other steps

    ``p0`` is what carrying any prefill chunk costs a step by itself: engines replay a decode-only
    batch as one captured CUDA graph and run a step with a prefill chunk piecewise or eagerly. In one
    model with the decode steps that cost had no term of its own and landed on the per-token one
    (several times what a token of a whole prompt costs, docs/scheduler.md), so chat
    prompts were cut into small chunks. ``keys`` is the context the prefill chunks read before their
    own tokens (each chunk its request's computed tokens): a chunk of a few queries at a long context
    costs about what reading that context costs, because prefill attention kernels parallelise over
    query tiles and heads, not over keys (decodes get split-KV kernels, so their keys count as pairs).

    Each fit forgets once per step of its own kind, so what the prefill fit learnt survives the
    decode-only steps between prompts. The prefill fit takes a step's time less the decodes' predicted
    part, so it starts once the decode fit has seen `WARMUP_STEPS` decode-only steps; until then the
    model is not `ready` and prefills are not capped.
    """

    def __init__(self, token_scale: float, pair_scale: float, key_scale: float | None = None) -> None:
        # pair_scale is token_scale times the longest context, which is also the scale of the keys read.
        key_scale = pair_scale / token_scale if key_scale is None else key_scale
        self.decodes = _DecayedFit((1.0, float(token_scale), float(pair_scale)))
        self.prefills = _DecayedFit((1.0, float(token_scale), float(pair_scale), float(key_scale)),
                                    prior=(PREFILL_STEP_PRIOR, 0.0, 0.0, 0.0))
        self.trace = StepTrace.from_env()

    def observe(self, seconds: float, decode_tokens: int = 0, decode_pairs: int = 0, prefill_tokens: int = 0,
                prefill_pairs: int = 0, prefill_keys: int = 0) -> None:  # fmt: skip
        """Fit one step's wall time: its decodes' tokens and attention pairs, and its prefill chunks'
        tokens, pairs and keys read before their own tokens."""
        decodes = (1.0, decode_tokens, decode_pairs)
        if self.trace is not None:
            self.trace.write(self, seconds, decode_tokens=decode_tokens, decode_pairs=decode_pairs,
                             prefill_tokens=prefill_tokens, prefill_pairs=prefill_pairs, prefill_keys=prefill_keys)
        if prefill_tokens:
            if self.decodes.count < WARMUP_STEPS:
                return  # the decodes' part of the step, and so the prefills' rest, is not known yet
            self.prefills.observe((1.0, prefill_tokens, prefill_pairs, prefill_keys),
                                  seconds - self.decodes.predict(decodes))  # fmt: skip
        else:
            self.decodes.observe(decodes, seconds)

    @property
    def ready(self) -> bool:
        return self.decodes.count >= WARMUP_STEPS

    @property
    def prefills_timed(self) -> int:
        """Steps with a prefill chunk the prefill fit has seen."""
        return self.prefills.count

    def decode_seconds(self, tokens: float, pairs: float) -> float:
        """Predicted time of a step carrying these decodes and no prefill chunk."""
        return self.decodes.predict((1.0, tokens, pairs))

    def step_seconds(self, decode_tokens: int = 0, decode_pairs: int = 0, prefill_tokens: int = 0,
                     prefill_pairs: int = 0, prefill_keys: int = 0) -> float:  # fmt: skip
        """Predicted time of a step with these features (those of `observe`)."""
        seconds = self.decode_seconds(decode_tokens, decode_pairs)
        if prefill_tokens:
            seconds += self.prefill_step_seconds + self.prefill_seconds_of(prefill_tokens, prefill_pairs, prefill_keys)
        return seconds

    @property
    def prefill_step_seconds(self) -> float:
        """What a step pays for carrying any prefill chunk, besides each chunk's own cost."""
        return self.prefills.coefficients[0]

    def prefill_seconds_of(self, tokens: int, pairs: int, keys: int) -> float:
        """Predicted time prefill chunks of these totals add to a step, besides `prefill_step_seconds`."""
        _, p1, p2, p3 = self.prefills.coefficients
        return p1 * tokens + p2 * pairs + p3 * keys

    def chunk_seconds(self, num_tokens: int, context: int) -> float:
        """Predicted time a prefill chunk of num_tokens after `context` computed tokens adds to a step
        that already carries a prefill chunk (without `prefill_step_seconds`)."""
        if num_tokens <= 0:
            return 0.0
        return self.prefill_seconds_of(num_tokens, attention_pairs(context, num_tokens), context)

    def max_chunk(self, seconds: float, context: int) -> int | None:
        """Largest chunk x at `context` computed tokens with chunk_seconds(x, context) <= seconds;
        None when unbounded (no cost learnt). Solves
        p2/2 x^2 + (p1 + p2 (context + 1/2)) x + p3 context <= seconds.
        """
        _, p1, p2, p3 = self.prefills.coefficients
        seconds -= p3 * context
        if seconds <= 0.0:
            return 0
        a, b = p2 / 2.0, p1 + p2 * (context + 0.5)
        if a > 0.0:
            return int((-b + math.sqrt(b * b + 4.0 * a * seconds)) / (2.0 * a))
        if b > 0.0:
            return int(seconds / b)
        return None

    def describe(self) -> str:
        d0, d1, d2 = self.decodes.coefficients
        p0, p1, p2, p3 = self.prefills.coefficients
        return (f"decodes {d0 * 1e3:.3f} ms + {d1 * 1e6:.3g} us/token + {d2 * 1e9:.3g} ns/pair; prefills "
                f"{p0 * 1e3:.3f} ms + {p1 * 1e6:.3g} us/token + {p2 * 1e9:.3g} ns/pair + {p3 * 1e9:.3g} ns/key")


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
    cost (its tokens and their attention over its own context) by the fitted :class:`StepTimeModel`,
    the step's first chunk also what carrying a prefill costs the step.

    The step planner (prefill_accel.engine.planner) builds on this: it times steps and feeds `model`,
    calls `start` with the step's decodes, and sizes each prefill chunk with `limit_tokens` and `charge`.

    A chunk too costly for the time left is cut, down to nothing when even reading its context does
    not fit: a chunk of a few tokens late in a long prompt costs a whole step of attention for
    little progress. Until a step with a prefill chunk has been timed (the model knows nothing of
    their cost), a chunk gets ``min_prefill_tokens``, a probe. Two exceptions keep prefills moving. When the decodes alone exceed the target
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
        self.seconds_left = self.target_s - self.model.decode_seconds(decode_tokens, decode_pairs)
        self.stats.step(self.seconds_left, self.model)
        self._steps_over_target = self._steps_over_target + 1 if self.seconds_left <= 0.0 else 0
        if self._steps_over_target == UNREACHABLE_STEPS and not self._warned:
            self._warned = True
            logger.warning(
                "--max-step-latency-ms %.1f is below the predicted time of the running decodes alone "
                "(%.1f ms over %d steps); prefills get only %d tokens per request per step. Raise the target.",
                self.target_s * 1e3, (self.target_s - self.seconds_left) * 1e3, UNREACHABLE_STEPS,
                self.min_prefill_tokens,
            )

    @property
    def prefill_seconds(self) -> float | None:
        """Time left in this step for prefill chunks' own costs: `seconds_left`, less what carrying a
        prefill costs the step while no chunk has paid it; None when prefills are not timed."""
        if self.seconds_left is None:
            return None
        return self.seconds_left - (0.0 if self._prefill_granted else self.model.prefill_step_seconds)

    def limit_tokens(self, context: int, num_new_tokens: int, seconds: float | None = None,
                     floor_each: bool = False) -> int:
        """How much of a prefill chunk of num_new_tokens after `context` computed tokens fits the step's
        time left (or `seconds`, a share of it).

        The exceptions of the class docstring apply to the step's first prefill chunk, or with
        `floor_each` to every prefill chunk (the caller bounds how many there are).
        """
        if self.seconds_left is None or num_new_tokens <= 0:
            return num_new_tokens
        if not self.model.prefills_timed:
            allowed = self.min_prefill_tokens  # a probe: its step's time starts the prefill fit
        else:
            available = self.prefill_seconds if seconds is None else min(seconds, self.prefill_seconds)
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
        self.seconds_left = self.prefill_seconds - self.model.chunk_seconds(num_tokens, context)
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

    def step(self, seconds_left: float, model: StepTimeModel) -> None:
        """Count a new timed step; once ``every`` steps are complete, first log them (their counts and
        the fitted model) and start over."""
        if self.every and self.steps == self.every:
            self._log(model)
            self._reset()
        self.steps += 1
        self.over_target += seconds_left <= 0.0
        self.min_left_s = min(self.min_left_s, seconds_left)

    def _log(self, model: StepTimeModel) -> None:
        logger.info(
            "step-latency budget, last %d timed steps: %d prefill chunks, %d capped, %d refused, %d at the "
            "floor, %d starvation releases; %d of %d tokens granted; decodes over the target in %d steps, "
            "least prefill time left %.2f ms; model: %s",
            self.steps, self.chunks, self.capped, self.refused, self.floored, self.released, self.granted,
            self.requested, self.over_target, self.min_left_s * 1e3, model.describe(),
        )  # fmt: skip
