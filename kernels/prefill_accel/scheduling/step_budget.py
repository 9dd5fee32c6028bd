"""A step's prefill time under ``--max-step-latency-ms``, spent chunk by chunk against the
:class:`~prefill_accel.scheduling.step_time.StepTimeModel`, and the periodic log of how the target
capped prefills (``PREFILL_ACCEL_BUDGET_STATS``)."""

from __future__ import annotations

import logging
import math
import os

from .step_time import StepTimeModel

# Consecutive steps whose decodes alone exceed the target before that is reported.
UNREACHABLE_STEPS = 100
# Steps whose prefill chunks got only the fixed-cost floor (the decodes leave less than twice the fixed
# cost of carrying a prefill, so no such step meets the target) before that is reported.
FIXED_FLOOR_STEPS = 16
# Consecutive steps in which every prefill chunk was refused (its context alone costs more than the
# time the decodes leave) before one step lets prefill chunks through uncapped: at most one step in
# this many runs over the target, fewer than 1%, and a long prompt still moves while decodes run.
STARVATION_STEPS = 128

logger = logging.getLogger("prefill_accel.scheduling")  # the package's one logger
# PREFILL_ACCEL_BUDGET_STATS=N: every N timed steps, one INFO line on how the target capped prefills.
BUDGET_STATS_ENV = "PREFILL_ACCEL_BUDGET_STATS"
TARGET_FLAG = "--max-step-latency-ms"


def check_target(max_step_latency_ms: float | None, flag: str = TARGET_FLAG) -> None:
    """Refuse a step latency target that is not a positive number of milliseconds (None: no target)."""
    if max_step_latency_ms is not None and not max_step_latency_ms > 0:
        raise ValueError(
            f"{flag} must be a positive number of milliseconds (the wall time a step that others wait for "
            f"should stay within), got {max_step_latency_ms}; leave it unset for no target"
        )


class PrefillTime:
    """A step's prefill time under a latency target, spent chunk by chunk, each chunk charged its own
    cost (its tokens and their attention over its own context) by the fitted :class:`StepTimeModel`,
    the step's first chunk also what carrying a prefill costs the step.

    The step planner (prefill_accel.engine.planner) builds on this: it times steps and feeds `model`,
    calls `start` with the step's decodes, and sizes each prefill chunk with `limit_tokens` and `charge`.

    A chunk too costly for the time left is cut, down to nothing when even reading its context does
    not fit: a chunk of a few tokens late in a long prompt costs a whole step of attention for
    little progress. What carrying a prefill costs the step (the model's fixed prefill cost) is paid
    whatever the chunk's size, so the step's chunks always get at least that much time for their own
    costs, however little the decodes leave: a step that carries a prefill is predicted at no more than
    the target or its decodes plus twice that cost, whichever is more (where the decodes leave less than
    twice that cost no such step meets the target: after FIXED_FLOOR_STEPS of them a warning names the
    target that would). Refusing instead would not bring
    any prefill step within the target, only hold a new request back until the decodes end (SGLang run 4,
    docs/sglang-0.5.md: chats waited for others' decodes, TTFT p99 247 ms unloaded). Until a step with a
    prefill chunk has been timed (the model knows nothing of their cost), a chunk gets
    ``min_prefill_tokens``, a probe. Two exceptions keep prefills moving. When the decodes alone exceed
    the target (set too low), the step's first chunk gets at least ``min_prefill_tokens``; and after
    `STARVATION_STEPS` steps in which prefill chunks were refused outright, one step takes them uncapped.
    """

    def __init__(self, max_step_latency_ms: float | None, token_scale: int, max_model_len: int,
                 min_prefill_tokens: int) -> None:
        check_target(max_step_latency_ms)
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
        self._fixed_floor_steps = 0
        self._fixed_floor_counted = False
        self.stats = BudgetStats.from_env()

    def start(self, decode_tokens: int, decode_pairs: int, others_waiting: bool = False) -> None:
        """A new step carrying these decodes: with a target and a fitted model, prefills get the time
        the decodes leave within it. Without decodes in the step they are timed only when
        ``others_waiting`` (requests outside the step wait for it to end: decodes that a prefill batch
        runs instead of, prefills queued behind its chunk); else nobody's latency is at stake."""
        self._starved_steps = self._starved_steps + 1 if self._refused and not self._prefill_granted else 0
        self.seconds_left = None
        self._prefill_granted = 0
        self._refused = False
        self._fixed_floor_counted = False
        if self.target_s is None or not (decode_tokens or others_waiting) or not self.model.ready:
            return
        self.seconds_left = self.target_s - self.model.decode_seconds(decode_tokens, decode_pairs)
        self.stats.step(self.seconds_left, self.model)
        self._steps_over_target = self._steps_over_target + 1 if self.seconds_left <= 0.0 else 0
        if self._steps_over_target == UNREACHABLE_STEPS and not self._warned:
            self._warned = True
            logger.warning(
                "--max-step-latency-ms %.1f is below the predicted time of the running decodes alone "
                "(%.1f ms over %d steps); a step's prefills get only the time carrying a prefill costs "
                "(%.1f ms), at least %d tokens. Raise the target.",
                self.target_s * 1e3, (self.target_s - self.seconds_left) * 1e3, UNREACHABLE_STEPS,
                self.model.prefill_step_seconds * 1e3, self.min_prefill_tokens,
            )

    @property
    def prefill_seconds(self) -> float | None:
        """Time left in this step for prefill chunks' own costs: `seconds_left`, less what carrying a
        prefill costs the step while no chunk has paid it, but never less than that cost itself (the
        class docstring); None when prefills are not timed."""
        if self.seconds_left is None:
            return None
        if self._prefill_granted:
            return self.seconds_left
        fixed = self.model.prefill_step_seconds
        return max(self.seconds_left - fixed, fixed)

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
            if not self._prefill_granted and 0.0 < self.seconds_left < 2.0 * self.model.prefill_step_seconds:
                self._count_fixed_floor()
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

    def _count_fixed_floor(self) -> None:
        """A step whose chunks get the fixed-cost floor: it cannot meet the target. Said once, after
        FIXED_FLOOR_STEPS such steps, with the target that would leave its chunks time of their own."""
        if self._fixed_floor_counted:
            return
        self._fixed_floor_counted = True
        self._fixed_floor_steps += 1
        if self._fixed_floor_steps == FIXED_FLOOR_STEPS:
            decodes = self.target_s - self.seconds_left
            fixed = self.model.prefill_step_seconds
            logger.warning(
                "--max-step-latency-ms %.1f leaves a prefill chunk beside the running decodes less time than "
                "carrying a prefill costs (decodes %.1f ms, carrying a prefill %.1f ms, over %d steps): such a "
                "step gets that cost's worth for its chunks and runs at about %.1f ms, over the target, and a "
                "prompt is split over several of them. A target of at least that keeps them within it.",
                self.target_s * 1e3, decodes * 1e3, fixed * 1e3, FIXED_FLOOR_STEPS, (decodes + 2 * fixed) * 1e3,
            )  # fmt: skip

    @property
    def granted_tokens(self) -> int:
        """Prefill tokens charged to this step so far."""
        return self._prefill_granted

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
        self.steps = self.chunks = self.capped = self.refused = self.floored = self.released = self.whole = 0
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
            "floor, %d starvation releases, %d whole past the target (uncuttable); %d of %d tokens granted; "
            "decodes over the target in %d steps, least prefill time left %.2f ms; model: %s",
            self.steps, self.chunks, self.capped, self.refused, self.floored, self.released, self.whole, self.granted,
            self.requested, self.over_target, self.min_left_s * 1e3, model.describe(),
        )  # fmt: skip
