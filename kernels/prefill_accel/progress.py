"""Progress display on stderr: one line per long step with its duration, and progress bars for counted work."""

from __future__ import annotations

import contextlib
import sys
import threading
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

    def bar(self, label: str, total: int) -> "Bar":
        """A progress bar over ``total`` items."""
        return Bar(self, label, total)


class Bar:
    """``label [#####.....] done/total status``: redrawn in place on a terminal, else a line every 10 %.
    Thread-safe: workers call ``advance`` as their items finish."""

    WIDTH = 30

    def __init__(self, progress: Progress, label: str, total: int):
        self.progress = progress
        self.label = label
        self.total = total
        self.done = 0
        self.start = time.monotonic()
        self.next_line = 0.0
        self.lock = threading.Lock()
        self.live = not progress.quiet and progress.stream.isatty()

    def render(self, status: str = "") -> str:
        filled = self.WIDTH * self.done // self.total if self.total else self.WIDTH
        line = (f"{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total} "
                f"{time.monotonic() - self.start:.0f} s")  # fmt: skip
        return f"{line} {status}".rstrip()

    def advance(self, count: int = 1, status: str = "") -> None:
        if self.progress.quiet:
            return
        with self.lock:
            self.done += count
            if self.live:
                end = "\n" if self.done >= self.total else ""
                print("\r" + self.render(status), end=end, file=self.progress.stream, flush=True)
            elif self.done >= self.total or self.done / max(self.total, 1) >= self.next_line:
                self.progress.note(self.render(status))
                self.next_line = self.done / max(self.total, 1) + 0.1
