"""`prefill-accel bench`: time to first token of an accelerated server against a baseline, over a ladder of
context lengths, requests interleaved so drift hits both servers alike."""

from __future__ import annotations

import datetime
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import __version__
from ..progress import Progress
from .client import APIS, Server, check_model, stream_completion
from .errors import ContextTooLong, ServerError, UsageError, require
from .prompts import PromptText
from .stats import summarize

DEFAULT_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
LIMIT_MARGIN = 0.02
"""Prompts at a server's max_model_len aim this share below the room left by the output: windows of text
cut to the same size differ by a few tokens once the server tokenizes them."""


@dataclass
class BenchConfig:
    """What `prefill-accel bench` measures; the fields are its flags."""

    url: str
    model: str
    baseline_url: str | None = None
    baseline_model: str | None = None
    """Model name on the baseline server (default: ``model``)."""
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    repeats: int = 5
    concurrency: int = 1
    warmup: int = 1
    max_tokens: int = 32
    api: str = "chat"
    corpus: Path | None = None
    tokenizer: str | None = None
    api_key: str | None = None
    """Sent to ``url`` only."""
    baseline_api_key: str | None = None
    """Sent to ``baseline_url``: a key is never sent to a server it was not given for."""
    timeout: float = 600.0
    ignore_eos: bool = False
    plots: bool = True
    out: Path = Path("bench-results")

    def __post_init__(self) -> None:
        if not self.lengths or any(n < 16 for n in self.lengths):
            raise UsageError(f"--lengths must be token counts >= 16, got {list(self.lengths)}")
        self.lengths = tuple(sorted(set(self.lengths)))
        for name in ("repeats", "concurrency", "max_tokens"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {self.warmup}")
        if self.api not in APIS:
            raise UsageError(f"--api must be one of {', '.join(APIS)}, got {self.api!r}")

    def servers(self) -> list[tuple[str, Server, str]]:
        """(name, server, model) of the baseline (if any) and the accelerated server."""
        found = []
        if self.baseline_url:
            found.append(("baseline", Server(self.baseline_url, self.baseline_api_key, self.timeout),
                          self.baseline_model or self.model))  # fmt: skip
        found.append(("accelerated", Server(self.url, self.api_key, self.timeout), self.model))
        return found


@dataclass
class Sample:
    """One timed request, in the order it was sent."""

    server: str
    length: int
    repeat: int
    """-1 - i for the i-th warm-up (not timed into the statistics)."""
    slot: int
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens_per_s: float | None = None
    error: str | None = None


@dataclass
class BenchRun:
    config: BenchConfig
    progress: Progress
    targets: dict[int, int] = field(default_factory=dict)
    """Prompt tokens aimed at per length (see :func:`prompt_targets`)."""
    samples: list[Sample] = field(default_factory=list)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    uncalibrated: bool = False
    """A warm-up came back without usage, so lengths could not be calibrated (said once)."""

    def request(self, name: str, server: Server, model: str, text: PromptText, units: int, length: int,
                repeat: int, slot: int) -> Sample:  # fmt: skip
        config = self.config
        sample = Sample(name, length, repeat, slot)
        tag = f"prefill-accel bench {self.run_id} {name} {length} {repeat} {slot}"
        prompt = text.prompt(units, max(repeat, 0) * config.concurrency + slot, tag)
        extra = {"ignore_eos": True} if config.ignore_eos else None
        try:
            done = stream_completion(server, config.api, model, prompt, config.max_tokens, extra)
        except ContextTooLong:
            raise
        except ServerError as error:
            sample.error = str(error)
        else:
            sample.prompt_tokens, sample.output_tokens = done.prompt_tokens, done.output_tokens
            sample.ttft_s, sample.e2e_s, sample.output_tokens_per_s = done.ttft_s, done.e2e_s, done.output_tokens_per_s
        return sample

    def wave(self, name, server, model, text, units, length, repeat, bar) -> list[Sample]:
        """``concurrency`` requests sent at once to one server."""
        count = self.config.concurrency if repeat >= 0 else 1
        with ThreadPoolExecutor(count) as pool:
            futures = [pool.submit(self.request, name, server, model, text, units, length, repeat, slot)
                       for slot in range(count)]  # fmt: skip
            wave = [f.result() for f in futures]
        self.samples.extend(wave)
        bar.advance(count, f"{length} tokens, {name}")
        return wave

    def measure(self, text: PromptText, bar) -> None:
        config = self.config
        servers = config.servers()
        for length in config.lengths:
            target = self.targets.get(length, length)
            units = text.initial_units(target)
            for w in range(config.warmup):
                for index, (name, server, model) in enumerate(servers):
                    (sample,) = self.wave(name, server, model, text, units, length, -1 - w, bar)
                    if index == 0 and sample.prompt_tokens:
                        units = text.calibrate(units, target, sample.prompt_tokens)
                    elif index == 0 and sample.error is None and not self.uncalibrated:
                        self.uncalibrated = True
                        self.progress.note(f"the {name} server sent no usage.prompt_tokens: prompt lengths are "
                                           "first guesses, not calibrated (--tokenizer cuts in the model's tokens)")
            for repeat in range(config.repeats):
                order = servers if repeat % 2 == 0 else servers[::-1]
                for name, server, model in order:
                    self.wave(name, server, model, text, units, length, repeat, bar)


def length_result(samples: list[Sample]) -> dict:
    timed = [s for s in samples if s.repeat >= 0 and s.error is None]
    return {
        "requests": len([s for s in samples if s.repeat >= 0]),
        "failures": [s.error for s in samples if s.repeat >= 0 and s.error is not None],
        "prompt_tokens": [s.prompt_tokens for s in timed],
        "output_tokens": [s.output_tokens for s in timed],
        "ttft_s": {"samples": [s.ttft_s for s in timed], **summarize([s.ttft_s for s in timed])},
        "e2e_s": {"samples": [s.e2e_s for s in timed], **summarize([s.e2e_s for s in timed])},
        "output_tokens_per_s": {
            "samples": [s.output_tokens_per_s for s in timed],
            **summarize([s.output_tokens_per_s for s in timed if s.output_tokens_per_s is not None]),
        },
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def results(run: BenchRun, text: PromptText, cards: dict[str, dict], started: str, error: str | None) -> dict:
    config = run.config
    servers = {}
    for name, server, model in config.servers():
        lengths = {}
        for length in config.lengths:
            mine = [s for s in run.samples if s.server == name and s.length == length]
            if mine:
                lengths[str(length)] = length_result(mine)
        servers[name] = {"url": server.url, "model": model, "max_model_len": cards[name].get("max_model_len"),
                         "lengths": lengths}  # fmt: skip
    speedup = {}
    if "baseline" in servers:
        for key, row in servers["accelerated"]["lengths"].items():
            base = servers["baseline"]["lengths"].get(key)
            if base:
                speedup[key] = {"ttft": ratio(base["ttft_s"]["median"], row["ttft_s"]["median"]),
                                "e2e": ratio(base["e2e_s"]["median"], row["e2e_s"]["median"])}  # fmt: skip
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()
                if k not in ("api_key", "baseline_api_key")}
    return {
        "tool": f"prefill-accel {__version__} bench",
        "started": started,
        "run_id": run.run_id,
        "prompt_tokens_target": {str(n): t for n, t in run.targets.items()},
        "config": settings,
        "corpus": {"source": text.source, "cut_in": text.unit_name},
        "servers": servers,
        "speedup": speedup,
        "requests": [asdict(s) for s in run.samples],
        "error": error,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def markdown(result: dict) -> str:
    """The run as a Markdown page: settings and one table row per context length."""
    config, servers = result["config"], result["servers"]
    names = list(servers)
    lines = [
        "# TTFT: " + ", ".join(f"{name} {server['url']}" for name, server in servers.items()), "",
        f"{result['tool']}, started {result['started']}; model `{config['model']}`, `/v1/"
        f"{'chat/completions' if config['api'] == 'chat' else 'completions'}` streamed, {config['repeats']} "
        f"repeat(s) x concurrency {config['concurrency']} per length and server after {config['warmup']} warm-up(s), "
        f"{config['max_tokens']} output tokens; prompts from {result['corpus']['source']}, each unique.", "",
    ]  # fmt: skip
    head = ["context", "prompt tokens"]
    for name in names:
        head += [f"{name} TTFT p50 / p90 / p99 (ms)", f"{name} e2e p50 (ms)", f"{name} out tok/s p50"]
    if result["speedup"]:
        head += ["TTFT speed-up", "e2e speed-up"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for length in config["lengths"]:
        key = str(length)
        rows = [servers[n]["lengths"].get(key) for n in names]
        if not any(rows):
            continue
        tokens = sorted(t for row in rows if row for t in row["prompt_tokens"] if t is not None)
        cells = [key, str(tokens[len(tokens) // 2]) if tokens else "-"]
        for row in rows:
            if row is None:
                cells += ["-", "-", "-"]
                continue
            t = row["ttft_s"]
            rate = row["output_tokens_per_s"]["median"]
            failed = f" ({len(row['failures'])} failed)" if row["failures"] else ""
            cells += [f"{_ms(t['median'])} / {_ms(t['p90'])} / {_ms(t['p99'])}{failed}", _ms(row["e2e_s"]["median"]),
                      "-" if rate is None else f"{rate:.1f}"]  # fmt: skip
        if result["speedup"]:
            s = result["speedup"].get(key, {})
            cells += [f"{s['ttft']:.2f}x" if s.get("ttft") else "-", f"{s['e2e']:.2f}x" if s.get("e2e") else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    if result["error"]:
        lines += ["", f"Stopped: {result['error']}"]
    return "\n".join(lines) + "\n"


def prompt_targets(config: BenchConfig, cards: dict[str, dict], progress: Progress) -> dict[int, int]:
    """The prompt tokens aimed at per length: the length itself, or, for a length at (or just under) a
    server's ``max_model_len``, what leaves room for the output and a margin. A length over a server's
    ``max_model_len`` is a usage error."""
    targets = {n: n for n in config.lengths}
    for name, server, model in config.servers():
        limit = cards[name].get("max_model_len")
        if not limit:
            continue
        if limit - config.max_tokens < 16:
            raise UsageError(f"--max-tokens {config.max_tokens} leaves no room for a prompt within the {name} "
                             f"server's max_model_len {limit}")  # fmt: skip
        too_long = [n for n in config.lengths if n > limit]
        if too_long:
            raise UsageError(f"the {name} server at {server.url} serves {model!r} with max_model_len {limit}: "
                             f"no room for {', '.join(map(str, too_long))}-token prompts plus {config.max_tokens} "
                             f"output tokens; drop them from --lengths or start it with a longer context")  # fmt: skip
        room = int((limit - config.max_tokens) * (1 - LIMIT_MARGIN))
        for n in config.lengths:
            if targets[n] > room:
                targets[n] = room
                progress.note(f"{n}: prompts of {targets[n]} tokens, leaving room for {config.max_tokens} output "
                              f"tokens and a {LIMIT_MARGIN:.0%} margin within the {name} server's max_model_len "
                              f"{limit}")  # fmt: skip
    return targets


def bench(config: BenchConfig, progress: Progress) -> dict:
    """Run the benchmark and write ``results.json``, ``results.md`` and the plots into ``config.out``.
    Returns the results; raises ContextTooLong (after writing) when a server refused a length."""
    if config.plots:
        require("matplotlib", "the bench plots (or pass --no-plots)")
    cards = {name: check_model(server, model) for name, server, model in config.servers()}
    run = BenchRun(config, progress, targets=prompt_targets(config, cards, progress))
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with progress.step(f"Loading prompt text for up to {max(config.lengths)} tokens"):
        text = PromptText.load(max(config.lengths), config.corpus, config.tokenizer)
    per_length = len(cards) * (config.warmup + config.repeats * config.concurrency)
    bar = progress.bar("bench", per_length * len(config.lengths))
    error = None
    try:
        run.measure(text, bar)
    except ContextTooLong as refused:
        error = str(refused)
    result = results(run, text, cards, started, error)
    write(result, config.out, config.plots)
    if error:
        raise ContextTooLong(f"{error}\nResults for the shorter lengths are in {config.out}.")
    return result


def write(result: dict, out: Path, plots: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(markdown(result))
    if plots:
        from .plots import plot_speedup, plot_ttft

        plot_ttft(result, out / "ttft.png")
        if result["speedup"]:
            plot_speedup(result, out / "speedup.png")
