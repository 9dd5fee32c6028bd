"""The serving subcommands of `prefill-accel`: bench and batch."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..commands import Command, progress_of

API_KEY_HELP = "API key sent as a Bearer token (default: $OPENAI_API_KEY)"


def parse_lengths(text: str) -> tuple[int, ...]:
    """``4096,8K,32k`` -> (4096, 8192, 32768)."""
    lengths = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            lengths.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"token counts like 4096,8K,32K; {part!r} is not one") from None
    return tuple(lengths)


def _server_args(p, what: str) -> None:
    p.add_argument("--url", required=True, help=f"{what} server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", required=True, help="model name as the server serves it (see GET /v1/models)")
    p.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions (default) or /v1/completions, streamed")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help=API_KEY_HELP)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds without data before a request fails (600)")


# bench ---------------------------------------------------------------------------------------------------

BENCH_EPILOG = """\
Every prompt is unique: its first line names the run and the request, so prefix caching cannot serve a
prompt from an earlier one and every request pays its full prefill. Prompts are cut from --corpus or, by
default, from the Python standard library's sources on this machine; with --tokenizer the cut is in the
model's tokens, otherwise in characters at a first guess of 3.6 per token. A warm-up request per length
and server (not timed) also calibrates the cut: the server's usage.prompt_tokens replaces the guess. The
prompt tokens each request really had are in results.json. Baseline and accelerated requests alternate
(which goes first alternates too), so drift hits both. Writes OUT/results.json, results.md, ttft.png and,
with a baseline, speedup.png. Exit 1 when requests failed or a server refused a length (what ran is
written), 2 on bad arguments, an unserved model or lengths over a server's max_model_len.
"""


def _configure_bench(p):
    _server_args(p, "the accelerated (patched)")
    p.add_argument("--baseline-url", help="the baseline (unpatched) server, measured side by side")
    p.add_argument("--baseline-api-key", default=os.environ.get("PREFILL_ACCEL_BASELINE_API_KEY"),
                   help="API key for --baseline-url (default: $PREFILL_ACCEL_BASELINE_API_KEY); --api-key is sent "
                        "to --url only")
    p.add_argument("--baseline-model", help="model name on the baseline server (default: --model)")
    p.add_argument("--lengths", type=parse_lengths, default="4K,8K,16K,32K,64K,128K",
                   help="context lengths in tokens, comma-separated, K = 1024 (default 4K,8K,16K,32K,64K,128K)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per length and server (5)")
    p.add_argument("--concurrency", type=int, default=1, help="requests sent at once in each round (1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests per length and server first (1)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (32)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly --max-tokens (vLLM/SGLang extension) so output lengths match")
    p.add_argument("--corpus", type=Path, metavar="FILE", help="text file to cut prompts from")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="the model's tokenizer (transformers) for exact cuts")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots (no matplotlib)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory (bench-results)")
    p.epilog = BENCH_EPILOG


def _run_bench(args) -> int:
    from .bench import BenchConfig, bench, markdown

    config = BenchConfig(
        url=args.url, model=args.model, baseline_url=args.baseline_url, baseline_model=args.baseline_model,
        lengths=args.lengths, repeats=args.repeats, concurrency=args.concurrency, warmup=args.warmup,
        max_tokens=args.max_tokens, api=args.api, corpus=args.corpus, tokenizer=args.tokenizer,
        api_key=args.api_key, baseline_api_key=args.baseline_api_key, timeout=args.timeout,
        ignore_eos=args.ignore_eos, plots=args.plots, out=args.out,
    )  # fmt: skip
    result = bench(config, progress_of(args))
    print(markdown(result), end="")
    print(f"Wrote {args.out}/results.json, results.md" + (" and the plots" if args.plots else ""))
    failed = sum(len(row["failures"]) for server in result["servers"].values() for row in server["lengths"].values())
    if failed:
        print(f"{failed} request(s) failed; their errors are in {args.out}/results.json")
        return 1
    return 0


# batch ---------------------------------------------------------------------------------------------------

BATCH_EPILOG = """\
OUTPUT_DIR/NAME.md is written only when its answer is complete (streamed into a hidden .partial file,
then renamed), so an interrupted run leaves no half answer behind; rerunning the command skips documents
whose .md exists and runs the rest. Transient errors (connection refused or dropped, HTTP 429 and 5xx, a
stream cut short) are retried after --backoff seconds, doubling; a prompt over the server's context or
another HTTP 4xx fails at once; so does an answer the server ended early (finish_reason "abort" is
retried, other reasons but stop/length/tool_calls fail). One JSON line per document goes to the log: file,
status (ok/failed/skipped/interrupted), prompt and completion tokens, TTFT, duration, attempts, error.
Ctrl-C or SIGTERM stops the requests in flight and starts no more; the log and the summary are still
written. Exit 1 when any document failed, 130 when interrupted.
"""


def _configure_batch(p):
    p.add_argument("input_dir", type=Path, metavar="INPUT_DIR", help="directory of *.txt documents")
    p.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR", help="where NAME.md answers go (created)")
    _server_args(p, "the")
    p.add_argument("--template", type=Path, metavar="FILE",
                   help="prompt template file with {document} (the text) and optionally {name} (file stem); "
                        "default: summarize the document in Markdown")
    p.add_argument("--concurrency", type=int, default=4, help="documents in flight at once (4)")
    p.add_argument("--max-tokens", type=int, default=1024, help="answer length limit in tokens (1024)")
    p.add_argument("--retries", type=int, default=1, help="retries of a transient error per document (1)")
    p.add_argument("--backoff", type=float, default=2.0, help="seconds before the first retry, doubled after (2)")
    p.add_argument("--log", type=Path, metavar="FILE", help="JSONL log, appended (default OUTPUT_DIR/batch-log.jsonl)")
    p.epilog = BATCH_EPILOG


def _run_batch(args) -> int:
    from .batch import Batch, BatchConfig

    config = BatchConfig(
        input_dir=args.input_dir, output_dir=args.output_dir, url=args.url, model=args.model, api=args.api,
        template=args.template, concurrency=args.concurrency, max_tokens=args.max_tokens, retries=args.retries,
        backoff=args.backoff, log=args.log, api_key=args.api_key, timeout=args.timeout,
    )  # fmt: skip
    summary = Batch(config, progress_of(args)).run()
    print(summary.render(config))
    if summary.interrupted:
        return 130
    return 0 if summary.ok else 1


SERVING_COMMANDS: dict[str, Command] = {
    "bench": Command("time to first token of an OpenAI-compatible server against a baseline, over context lengths",
                     _configure_bench, _run_bench),
    "batch": Command("run INPUT_DIR/*.txt through a prompt template on a server into OUTPUT_DIR/*.md, resumable",
                     _configure_batch, _run_batch),
}
