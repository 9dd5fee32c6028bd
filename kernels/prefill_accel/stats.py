"""Opt-in statistics of the sparse path, for diagnosing it inside an engine.

``PREFILL_ACCEL_STATS=N`` (N > 0) makes :func:`prefill_accel.sparse_prefill_attention` time its block
search and its attention kernel on every call and log, every N calls, one line on the logger
``prefill_accel.stats``: calls, query tokens, the share of causal key blocks kept, and the milliseconds
spent in each stage. Each call then synchronises the device once per stage, so leave it off when
measuring speed; unset or 0 costs nothing.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

ENV = "PREFILL_ACCEL_STATS"
logger = logging.getLogger("prefill_accel.stats")


def interval() -> int:
    """Calls between two log lines; 0 when statistics are off (the default)."""
    value = os.environ.get(ENV, "0").strip() or "0"
    try:
        calls = int(value)
    except ValueError:
        raise ValueError(f"{ENV} must be a whole number of calls, got {value!r}") from None
    return max(calls, 0)


@dataclass
class SparseCallStats:
    """Running totals since the last log line."""

    calls: int = 0
    q_tokens: int = 0
    kept_blocks: int = 0
    causal_blocks: int = 0
    select_ms: float = 0.0
    attention_ms: float = 0.0

    def line(self) -> str:
        density = self.kept_blocks / max(self.causal_blocks, 1)
        return (
            f"sparse prefill: {self.calls} calls, {self.q_tokens} query tokens, density {density:.3f}, "
            f"search {self.select_ms:.1f} ms, attention {self.attention_ms:.1f} ms "
            f"({(self.select_ms + self.attention_ms) / max(self.calls, 1):.2f} ms per call)"
        )


class _Clock:
    """Wall milliseconds of a stage, with the device synchronised at each mark."""

    def __init__(self, device: torch.device) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.sync()
        self.last = time.perf_counter()

    def lap(self) -> float:
        self.sync()
        now = time.perf_counter()
        elapsed, self.last = (now - self.last) * 1e3, now
        return elapsed


class StatsRecorder:
    """Collects :class:`SparseCallStats` and logs them every ``every`` calls."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.totals = SparseCallStats()
        # Asking for statistics is asking for these lines: an engine's root logger usually sits at
        # WARNING, which would drop them, and may have no handler at all.
        logger.setLevel(logging.INFO)
        if not logger.hasHandlers():
            logger.addHandler(logging.StreamHandler())

    def start(self, device: torch.device) -> _Clock:
        return _Clock(device)

    def record(self, q_tokens: int, kept_blocks: int, causal_blocks: int, select_ms: float, attention_ms: float) -> None:
        t = self.totals
        t.calls += 1
        t.q_tokens += q_tokens
        t.kept_blocks += kept_blocks
        t.causal_blocks += causal_blocks
        t.select_ms += select_ms
        t.attention_ms += attention_ms
        if t.calls >= self.every:
            logger.info(t.line())
            self.totals = SparseCallStats()


_recorder: StatsRecorder | None = None


def recorder() -> StatsRecorder | None:
    """The process's recorder when ``PREFILL_ACCEL_STATS`` is set, else None."""
    global _recorder
    every = interval()
    if every == 0:
        return None
    if _recorder is None or _recorder.every != every:
        _recorder = StatsRecorder(every)
    return _recorder
