"""`prefill-accel batch` against a real local HTTP server (serving_stub): resume, retry, failures, the log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import prefill_accel
import pytest
from prefill_accel.cli import main
from prefill_accel.serving.batch import DEFAULT_TEMPLATE, Batch, BatchConfig
from prefill_accel.progress import Progress
from serving_stub import StubServer, answer

MODEL = "stub-model"


def documents(folder: Path, count: int) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    texts = {f"doc{i}": f"Document number {i}. " + "The harbour light turns at night. " * (20 + i) for i in range(count)}
    for stem, text in texts.items():
        (folder / f"{stem}.txt").write_text(text)
    (folder / "notes.md").write_text("not a .txt input")
    return texts


def expected(stem: str, text: str, max_tokens: int, template: str = DEFAULT_TEMPLATE) -> str:
    return answer(template.replace("{name}", stem).replace("{document}", text), max_tokens) + "\n"


def log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def batch(inp: Path, out: Path, url: str, *args: str) -> int:
    return main(["batch", "-q", str(inp), str(out), "--url", url, "--model", MODEL, "--max-tokens", "5", *args])


def test_batch_writes_every_document_logs_it_and_resumes(tmp_path, capsys):
    texts = documents(tmp_path / "in", 5)
    out = tmp_path / "out"
    with StubServer(ttft_base=0.02) as stub:
        assert batch(tmp_path / "in", out, stub.url, "--concurrency", "2") == 0
        assert "5 document(s): 5 written, 0 skipped (finished before), 0 failed" in capsys.readouterr().out
        assert sorted(p.name for p in out.iterdir()) == ["batch-log.jsonl"] + [f"doc{i}.md" for i in range(5)]
        for stem, text in texts.items():
            assert (out / f"{stem}.md").read_text() == expected(stem, text, 5)
        lines = log_lines(out / "batch-log.jsonl")
        assert sorted(line["file"] for line in lines) == [f"doc{i}.txt" for i in range(5)]
        for line in lines:
            assert line["status"] == "ok" and line["attempts"] == 1 and line["completion_tokens"] == 5
            assert line["prompt_tokens"] > 100 and 0.02 <= line["ttft_s"] <= line["duration_s"]
        requests = len(stub.state.log)

        (out / "doc3.md").unlink()
        assert batch(tmp_path / "in", out, stub.url) == 0
        assert "5 document(s): 1 written, 4 skipped" in capsys.readouterr().out
        assert len(stub.state.log) == requests + 1 and "Document number 3." in stub.state.log[-1]["prompt"]
    statuses = [line["status"] for line in log_lines(out / "batch-log.jsonl")[5:]]
    assert sorted(statuses) == ["ok"] + ["skipped"] * 4


def test_batch_retries_transient_errors_once_with_backoff(tmp_path):
    texts = documents(tmp_path / "in", 3)
    out = tmp_path / "out"
    sleeps = []
    with StubServer() as stub:
        stub.fail("503", when="Document number 0.")
        stub.fail("drop", when="Document number 1.")
        config = BatchConfig(tmp_path / "in", out, stub.url, MODEL, max_tokens=5, backoff=0.5)
        summary = Batch(config, Progress(quiet=True), sleep=sleeps.append).run()
        outcomes = sorted((e["prompt"].split("Document number ")[1][0], e["outcome"]) for e in stub.state.log)
    assert summary.ok and sorted(summary.written) == ["doc0.txt", "doc1.txt", "doc2.txt"]
    assert sleeps == [0.5, 0.5]
    assert outcomes == [("0", "503"), ("0", "ok"), ("1", "drop"), ("1", "ok"), ("2", "ok")]
    for stem, text in texts.items():
        assert (out / f"{stem}.md").read_text() == expected(stem, text, 5)
    attempts = {line["file"]: line["attempts"] for line in log_lines(out / "batch-log.jsonl")}
    assert attempts == {"doc0.txt": 2, "doc1.txt": 2, "doc2.txt": 1}
    assert not list(out.glob(".*"))


def test_batch_reports_failures_and_exits_non_zero(tmp_path, capsys):
    texts = documents(tmp_path / "in", 4)
    (tmp_path / "in" / "huge.txt").write_text("x" * 20_000)
    out = tmp_path / "out"
    with StubServer(max_model_len=3000) as stub:
        stub.fail("500", when="Document number 2.", times=2)
        assert batch(tmp_path / "in", out, stub.url, "--backoff", "0") == 1
        report = capsys.readouterr().out
        assert "5 document(s): 3 written, 0 skipped (finished before), 2 failed" in report
        assert "failed doc2.txt:" in report and "HTTP 500" in report
        assert "failed huge.txt:" in report and "longer than the server accepts" in report
        lines = {line["file"]: line for line in log_lines(out / "batch-log.jsonl")}
        assert (lines["doc2.txt"]["status"], lines["doc2.txt"]["attempts"]) == ("failed", 2)
        assert (lines["huge.txt"]["status"], lines["huge.txt"]["attempts"]) == ("failed", 1)  # no retry of a 400
        assert not (out / "doc2.md").exists() and not (out / "huge.md").exists()

        # The failures pass: a rerun runs only them, and doc2 comes out whole.
        assert batch(tmp_path / "in", out, stub.url) == 1  # huge.txt is still too long
        assert "1 written, 3 skipped (finished before), 1 failed" in capsys.readouterr().out
    assert (out / "doc2.md").read_text() == expected("doc2", texts["doc2"], 5)


def test_batch_template_and_usage_errors(tmp_path, capsys):
    texts = documents(tmp_path / "in", 1)
    template = tmp_path / "template.txt"
    template.write_text("Translate {name}:\n{document}")
    with StubServer() as stub:
        assert batch(tmp_path / "in", tmp_path / "out", stub.url, "--template", str(template)) == 0
        assert (tmp_path / "out" / "doc0.md").read_text() == expected("doc0", texts["doc0"], 5, template.read_text())
        template.write_text("no placeholder")
        assert batch(tmp_path / "in", tmp_path / "out2", stub.url, "--template", str(template)) == 2
        assert "no {document} placeholder" in capsys.readouterr().err
        assert main(["batch", "-q", str(tmp_path / "in"), str(tmp_path / "out3"), "--url", stub.url, "--model", "nope"]) == 2
        assert "does not serve model 'nope'" in capsys.readouterr().err
        assert batch(tmp_path / "missing", tmp_path / "out4", stub.url) == 2
    assert not (tmp_path / "out3").exists()


def test_batch_resumes_after_a_kill_without_losing_or_repeating_documents(tmp_path):
    texts = documents(tmp_path / "in", 6)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(prefill_accel.__file__).parents[1])}
    with StubServer(ttft_base=0.05, itl=0.03) as stub:
        command = [sys.executable, "-m", "prefill_accel.cli", "batch", "-q", str(tmp_path / "in"), str(out), "--url",
                   stub.url, "--model", MODEL, "--max-tokens", "20", "--concurrency", "2"]  # fmt: skip
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        # Kill it while two answers are done and the next ones are being written.
        while not (len(list(out.glob("*.md"))) >= 2 and list(out.glob(".*.partial"))):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait()
        finished = sorted(p.stem for p in out.glob("*.md"))
        assert 2 <= len(finished) < 6 and list(out.glob(".*.partial"))
        for stem in finished:
            assert (out / f"{stem}.md").read_text() == expected(stem, texts[stem], 20)
        before = len(stub.state.log)

        assert batch(tmp_path / "in", out, stub.url, "--max-tokens", "20") == 0
        rerun = [e["prompt"].split("Document number ")[1].split(".")[0] for e in stub.state.log[before:]]
    assert sorted(f"doc{i}" for i in rerun) == sorted(set(texts) - set(finished))  # each remaining one once
    for stem, text in texts.items():
        assert (out / f"{stem}.md").read_text() == expected(stem, text, 20)
    assert not list(out.glob(".*.partial"))
    lines = log_lines(out / "batch-log.jsonl")
    assert sorted(line["file"] for line in lines if line["status"] == "ok") == sorted(f"{s}.txt" for s in texts)


def test_batch_reports_an_unreadable_document(tmp_path, capsys):
    documents(tmp_path / "in", 2)
    (tmp_path / "in" / "broken.txt").symlink_to(tmp_path / "nowhere")
    with StubServer() as stub:
        assert batch(tmp_path / "in", tmp_path / "out", stub.url) == 1
    assert "failed broken.txt: cannot read" in capsys.readouterr().out
    assert (tmp_path / "out" / "doc0.md").exists() and (tmp_path / "out" / "doc1.md").exists()


def test_batch_never_saves_an_answer_the_server_aborted(tmp_path, capsys):
    texts = documents(tmp_path / "in", 2)
    out = tmp_path / "out"
    with StubServer() as stub:
        stub.fail("abort", when="Document number 0.", times=2)
        assert batch(tmp_path / "in", out, stub.url, "--backoff", "0") == 1
        report = capsys.readouterr().out
        assert "failed doc0.txt:" in report and "finish_reason 'abort' after 3 text chunk(s)" in report
        lines = {line["file"]: line for line in log_lines(out / "batch-log.jsonl")}
        assert (lines["doc0.txt"]["status"], lines["doc0.txt"]["attempts"]) == ("failed", 2)  # retried once
        assert not (out / "doc0.md").exists() and not list(out.glob(".*.partial"))
        # A rerun does not skip it: the document is asked again and written whole.
        assert batch(tmp_path / "in", out, stub.url) == 0
        assert "1 written, 1 skipped" in capsys.readouterr().out
    assert (out / "doc0.md").read_text() == expected("doc0", texts["doc0"], 5)


def test_batch_logs_a_malformed_stream_and_goes_on(tmp_path, capsys):
    documents(tmp_path / "in", 3)
    out = tmp_path / "out"
    with StubServer() as stub:
        stub.fail("bad-utf8", when="Document number 0.")
        stub.fail("choices-object", when="Document number 1.")
        assert batch(tmp_path / "in", out, stub.url, "--retries", "0") == 1
    report = capsys.readouterr().out
    assert "3 document(s): 1 written, 0 skipped (finished before), 2 failed" in report
    assert "failed doc0.txt:" in report and "not UTF-8" in report
    assert "failed doc1.txt:" in report and "choices are not a list" in report
    lines = {line["file"]: line["status"] for line in log_lines(out / "batch-log.jsonl")}
    assert lines == {"doc0.txt": "failed", "doc1.txt": "failed", "doc2.txt": "ok"}
    assert sorted(p.name for p in out.glob("*.md")) == ["doc2.md"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_batch_stops_at_once_when_interrupted_and_still_logs_and_summarises(tmp_path, sig):
    documents(tmp_path / "in", 6)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(prefill_accel.__file__).parents[1])}
    with StubServer(ttft_base=30.0) as stub:  # every answer would take 30 s
        command = [sys.executable, "-m", "prefill_accel.cli", "batch", "-q", str(tmp_path / "in"), str(out), "--url",
                   stub.url, "--model", MODEL, "--concurrency", "2"]  # fmt: skip
        # SIGINT as a terminal delivers it: a background job's inherited SIG_IGN would stay (Python keeps it).
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
        deadline = time.monotonic() + 60
        while len(stub.state.log) < 2:
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.01)
        sent = time.monotonic()
        os.killpg(process.pid, sig)  # as a terminal's Ctrl-C reaches the whole process group
        stdout, stderr = process.communicate(timeout=20)
        stopped_in = time.monotonic() - sent
        requests = len(stub.state.log)
    assert process.returncode == 130, stderr
    assert stopped_in < 10  # not after the 30 s answers, nor after the four documents still queued
    assert requests == 2
    assert "6 document(s): 0 written, 0 skipped (finished before), 0 failed, 6 not finished (interrupted)" in stdout
    assert "Rerun the same command" in stdout
    lines = log_lines(out / "batch-log.jsonl")
    assert sorted(line["file"] for line in lines) == [f"doc{i}.txt" for i in range(6)]
    assert {line["status"] for line in lines} == {"interrupted"}
    assert not list(out.glob("*.md")) and not list(out.glob(".*.partial"))
