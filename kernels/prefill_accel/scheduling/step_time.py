"""The online model of a step's wall time: its decodes' cost plus what its prefill chunks add
(tokens, attention pairs, keys read), fitted by decayed least squares from the steps the engine
times, and the optional trace of those steps (``PREFILL_ACCEL_STEP_TRACE``)."""

from __future__ import annotations

import json
import math
import os
import time

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
