"""The `prefill-accel` command line: one entry point, subcommands dispatched from a table.

Each subcommand is a `Command` (help text, an argument-adding function and a run function returning an
exit code). Tooling commands come from prefill_accel.tooling.commands; other areas add their own table
to COMMAND_TABLES (e.g. bench, batch, accuracy) without touching the dispatch.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .commands import Command
from .errors import CommandError
from .serving.commands import SERVING_COMMANDS
from .tooling.commands import TOOLING_COMMANDS

COMMAND_TABLES: tuple[dict[str, Command], ...] = (TOOLING_COMMANDS, SERVING_COMMANDS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefill-accel",
        description="Block-sparse prefill attention for vLLM and SGLang: patch-series tooling and serving tools.",
        epilog="Exit codes: 0 ok, 1 operation failed, 2 usage error, 3 patch does not apply, "
               "4 already applied, 5 overlay conflict, 6 checksum mismatch, 7 rebase conflict, 130 interrupted.",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr")
    common = argparse.ArgumentParser(add_help=False)  # -q after the command too; it never unsets -q before it
    common.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="no progress output on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for table in COMMAND_TABLES:
        for name, command in table.items():
            child = sub.add_parser(name, help=command.help, description=command.help, parents=[common])
            command.configure(child)
            child.set_defaults(run=command.run)
    return parser


def _terminate(number, frame):
    raise KeyboardInterrupt(signal.Signals(number).name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None  # a supervisor's stop, as Ctrl-C
    try:
        return args.run(args)
    except CommandError as e:
        print(f"prefill-accel {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        print(f"prefill-accel {args.command}: interrupted ({e or 'SIGINT'})", file=sys.stderr)
        return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
