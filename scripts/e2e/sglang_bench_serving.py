"""SGLang's own serving benchmark, several runs in one process: each command line read from stdin (a JSON
list of argument lists) goes through `python -m sglang.bench_serving`'s own entry point in turn, so SGLang
is imported once instead of once per run (some 25 s each on the GPU machine). A run that fails is reported
and the next one still runs; the exit status says whether any failed.

Usage: echo '[["--base-url", "http://127.0.0.1:8111", ...], ...]' | python scripts/e2e/sglang_bench_serving.py
"""

import json
import sys
import traceback

from sglang.benchmark.serving import cli_main


def main() -> int:
    failed = 0
    for argv in json.load(sys.stdin):
        sys.argv = ["sglang.bench_serving", *argv]
        print(f"== sglang.bench_serving {' '.join(argv)}", flush=True)
        try:
            cli_main()
        except (Exception, SystemExit) as error:  # argparse exits; the next run goes on either way
            failed += 1
            print(f"== run failed: {error!r}\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
