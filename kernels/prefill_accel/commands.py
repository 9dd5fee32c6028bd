"""What every `prefill-accel` subcommand is made of, shared by the tooling and the serving tools."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

from .progress import Progress


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its help, a function adding its arguments, a function running it (-> exit code)."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def progress_of(args) -> Progress:
    return Progress(quiet=getattr(args, "quiet", False))
