"""`prefill-accel batch`: every ``INPUT_DIR/*.txt`` through a prompt template to an OpenAI-compatible server,
the answer to ``OUTPUT_DIR/<name>.md``; resumable, retrying transient errors, logged per document."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from ..progress import Progress
from .client import APIS, Cancel, Server, check_model, stream_completion
from .errors import Cancelled, ServerError, TransientServerError, UsageError

DEFAULT_TEMPLATE = (
    "Summarize the document below in Markdown: a one-line title, then its main points as a bulleted list.\n\n"
    "Document {name}:\n\n{document}\n"
)
PARTIAL_SUFFIX = ".partial"
"""An answer being written is ``OUTPUT_DIR/.<name>.md.partial`` until it is complete and renamed."""


@dataclass
class BatchConfig:
    """What `prefill-accel batch` runs; the fields are its arguments and flags."""

    input_dir: Path
    output_dir: Path
    url: str
    model: str
    api: str = "chat"
    template: Path | None = None
    """A file holding the prompt, with ``{document}`` (the text) and optionally ``{name}`` (the file stem)."""
    concurrency: int = 4
    max_tokens: int = 1024
    retries: int = 1
    backoff: float = 2.0
    """Seconds before the first retry, doubled for each further one."""
    log: Path | None = None
    """JSONL log, appended to (default OUTPUT_DIR/batch-log.jsonl)."""
    api_key: str | None = None
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.input_dir.is_dir():
            raise UsageError(f"INPUT_DIR {self.input_dir} is not a directory")
        for name in ("concurrency", "max_tokens"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.retries < 0 or self.backoff < 0:
            raise UsageError("--retries and --backoff must be >= 0")
        if self.api not in APIS:
            raise UsageError(f"--api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.log is None:
            self.log = self.output_dir / "batch-log.jsonl"

    def prompt_template(self) -> str:
        if self.template is None:
            return DEFAULT_TEMPLATE
        try:
            text = self.template.read_text(encoding="utf-8")
        except OSError as error:
            raise UsageError(f"cannot read --template {self.template}: {error}") from error
        if "{document}" not in text:
            raise UsageError(f"--template {self.template} has no {{document}} placeholder for the document's text")
        return text


@dataclass
class BatchSummary:
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    """Documents in flight or not yet started when the run was interrupted."""
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed and not self.interrupted

    def render(self, config: BatchConfig) -> str:
        total = len(self.written) + len(self.skipped) + len(self.failed) + len(self.stopped)
        lines = [f"batch: {total} document(s): {len(self.written)} written, {len(self.skipped)} skipped "
                 f"(finished before), {len(self.failed)} failed"
                 + (f", {len(self.stopped)} not finished (interrupted)" if self.interrupted else "")
                 + f"; log {config.log}"]  # fmt: skip
        lines += [f"  failed {name}: {error}" for name, error in sorted(self.failed.items())]
        if self.failed or self.interrupted:
            lines.append("Rerun the same command to run the documents not written; finished ones are skipped.")
        return "\n".join(lines)


class Batch:
    def __init__(self, config: BatchConfig, progress: Progress, sleep=None):
        self.config = config
        self.progress = progress
        self.server = Server(config.url, config.api_key, config.timeout)
        self.template = config.prompt_template()
        self.lock = threading.Lock()
        self.summary = BatchSummary()
        self.cancel = Cancel()
        self.sleep = sleep or self.cancel.wait  # a backoff ends at once when the run is interrupted

    def output(self, document: Path) -> Path:
        return self.config.output_dir / f"{document.stem}.md"

    def partial(self, document: Path) -> Path:
        return self.config.output_dir / f".{document.stem}.md{PARTIAL_SUFFIX}"

    def log(self, record: dict) -> None:
        record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **record}
        with self.lock, open(self.config.log, "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")

    def attempt(self, document: Path, prompt: str):
        """One request, its text streamed into the partial file, renamed to the output when complete."""
        partial = self.partial(document)
        try:
            with open(partial, "w", encoding="utf-8") as out:
                done = stream_completion(self.server, self.config.api, self.config.model, prompt,
                                         self.config.max_tokens, on_text=out.write, cancel=self.cancel)  # fmt: skip
                if not done.text.endswith("\n"):
                    out.write("\n")
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, self.output(document))
        return done

    def process(self, document: Path) -> str:
        """Run one document with retries; log it; return its status."""
        name = document.name
        start = time.monotonic()
        record: dict = {"file": name, "output": self.output(document).name}
        try:
            text = document.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            return self.finish(record, "failed", 0, start, f"cannot read {document}: {error}")
        record["chars"] = len(text)
        prompt = self.template.replace("{name}", document.stem).replace("{document}", text)
        attempt = 0
        while True:
            if self.cancel.cancelled:
                return self.finish(record, "interrupted", attempt, start, "the run was interrupted")
            attempt += 1
            try:
                done = self.attempt(document, prompt)
            except Cancelled:
                return self.finish(record, "interrupted", attempt, start, "the run was interrupted")
            except TransientServerError as error:
                if attempt > self.config.retries:
                    return self.finish(record, "failed", attempt, start, str(error))
                self.progress.note(f"{name}: {error}; retrying")
                self.sleep(self.config.backoff * 2 ** (attempt - 1))
                continue
            except ServerError as error:
                return self.finish(record, "failed", attempt, start, str(error))
            except OSError as error:
                return self.finish(record, "failed", attempt, start, f"cannot write the answer: {error}")
            record.update(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                          ttft_s=round(done.ttft_s, 4), finish_reason=done.finish_reason)  # fmt: skip
            return self.finish(record, "ok", attempt, start)

    def finish(self, record: dict, status: str, attempts: int, start: float, error: str | None = None) -> str:
        """Log one document's outcome, count it in the summary and return its status."""
        record.update(status=status, attempts=attempts, duration_s=round(time.monotonic() - start, 4))
        if error is not None:
            record["error"] = error
        self.log(record)
        with self.lock:
            if status == "ok":
                self.summary.written.append(record["file"])
            elif status == "interrupted":
                self.summary.stopped.append(record["file"])
            else:
                self.summary.failed[record["file"]] = error
        return status

    def run(self) -> BatchSummary:
        config = self.config
        documents = sorted(config.input_dir.glob("*.txt"))
        if not documents:
            raise UsageError(f"no *.txt files in {config.input_dir}")
        check_model(self.server, config.model)
        config.output_dir.mkdir(parents=True, exist_ok=True)
        for stale in config.output_dir.glob(f".*.md{PARTIAL_SUFFIX}"):
            stale.unlink()
        todo = []
        for document in documents:
            if self.output(document).exists():
                self.summary.skipped.append(document.name)
                self.log({"file": document.name, "output": self.output(document).name, "status": "skipped"})
            else:
                todo.append(document)
        self.progress.note(f"batch: {len(documents)} document(s), {len(self.summary.skipped)} finished before, "
                           f"{len(todo)} to run on {config.url} ({config.model}), {config.concurrency} at a time")
        bar = self.progress.bar("batch", len(todo))
        running: dict = {}
        with ThreadPoolExecutor(config.concurrency) as pool:
            try:
                for document in todo:
                    running[pool.submit(self.process, document)] = document
                for finished in as_completed(running):
                    bar.advance(1, f"{running[finished].name} {finished.result()}")
            except KeyboardInterrupt:
                self.interrupt(todo, running)
        return self.summary

    def interrupt(self, todo: list[Path], running: dict) -> None:
        """Ctrl-C or SIGTERM: stop the requests in flight, start no more, log each document not finished."""
        self.summary.interrupted = True
        self.cancel.cancel()
        self.progress.note("batch: interrupted; stopping the requests in flight")
        submitted = set(running.values())
        never = [doc for future, doc in running.items() if future.cancel()] + [d for d in todo if d not in submitted]
        for document in never:
            self.finish({"file": document.name, "output": self.output(document).name}, "interrupted", 0,
                        time.monotonic(), "the run was interrupted before it started")  # fmt: skip
        for future in running:
            if not future.cancelled():
                future.exception()  # wait: its worker logs it (its socket is shut, so it ends at once)
