"""Progress display for long steps: one line per step on stderr, with its duration."""

from __future__ import annotations

import contextlib
import sys
import time


class Progress:
    """Prints `==> step` before and `    done (1.2 s)` after each long step; quiet=True prints nothing."""

    def __init__(self, quiet: bool = False, stream=None):
        self.quiet = quiet
        self.stream = stream or sys.stderr

    def note(self, message: str) -> None:
        if not self.quiet:
            print(message, file=self.stream, flush=True)

    @contextlib.contextmanager
    def step(self, message: str):
        self.note(f"==> {message}")
        start = time.monotonic()
        yield
        self.note(f"    done ({time.monotonic() - start:.1f} s)")

    def bytes(self, label: str, total: int | None):
        """A callback `update(done_bytes)` that reports a transfer in 10 % steps."""
        state = {"next": 0.1}

        def update(done: int) -> None:
            if self.quiet or not total:
                return
            if done / total >= state["next"] or done == total:
                self.note(f"    {label}: {done / 2**20:.1f} / {total / 2**20:.1f} MiB")
                state["next"] = done / total + 0.1

        return update
