"""The serving client, statistics and `prefill-accel bench`, against a real local HTTP server (serving_stub)."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
from PIL import Image

from prefill_accel.cli import main
from prefill_accel.serving import client
from prefill_accel.serving.commands import parse_lengths
from prefill_accel.serving.errors import (
    ContextTooLong,
    ModelNotServed,
    ServerError,
    ServerUnreachable,
    TransientServerError,
    UsageError,
)
from prefill_accel.serving.prompts import PromptText
from prefill_accel.serving.stats import percentile, summarize
from serving_stub import StubServer, answer

MODEL = "stub-model"


# statistics ----------------------------------------------------------------------------------------------


def test_percentiles_match_hand_computed_values():
    values = [10, 1, 9, 2, 8, 3, 7, 4, 6, 5]  # unsorted on purpose
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)  # rank 8.1: 9 + 0.1 * (10 - 9)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([4.0], 99) == 4.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)
    rng = np.random.default_rng(0)
    sample = list(rng.exponential(size=37))
    for q in (10, 50, 90, 99):
        assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))
    assert summarize([2.0, 4.0]) == {"median": 3.0, "p90": pytest.approx(3.8), "p99": pytest.approx(3.98),
                                     "mean": 3.0, "min": 2.0, "max": 4.0}  # fmt: skip
    assert set(summarize([]).values()) == {None}


# SSE parsing and errors ----------------------------------------------------------------------------------


def test_sse_data_joins_lines_and_skips_comments():
    raw = [b": keep-alive\n", b"\n", b'data: {"a": 1}\r\n', b"\r\n", b"event: x\n", b"data:first\n",
           b"data: second\n", b"\n", b"id: 3\n", b"data: [DONE]"]  # fmt: skip
    assert list(client.sse_data(raw)) == ['{"a": 1}', "first\nsecond", "[DONE]"]


def test_error_message_forms():
    assert client.error_message(b'{"error": {"message": "too long", "code": 400}}') == "too long"
    assert client.error_message(b'{"object": "error", "message": "bad model"}') == "bad model"
    assert client.error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert client.error_message(b"plain text") == "plain text"


# the client against the stub -----------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_stream_times_first_text_not_the_role_chunk(api):
    # The stub sends the role-only chat chunk and a comment at once, the first text 0.15 s later.
    with StubServer(ttft_base=0.15, itl=0.01) as stub:
        prompt = "word " * 400
        done = client.stream_completion(client.Server(stub.url), api, MODEL, prompt, 6)
        logged = stub.state.log[0]
    assert 0.15 <= done.ttft_s < 0.25
    # The last text leaves the stub 5 intervals after the first; a loaded machine may read the first
    # one late, so the bound is on the whole stream, which the client cannot see end early.
    assert done.e2e_s >= 0.15 + 5 * 0.01
    assert done.text == answer(prompt, 6)
    assert (done.chunks, done.completion_tokens, done.finish_reason) == (6, 6, "length")
    assert done.prompt_tokens == logged["prompt_tokens"] == 500 + (7 if api == "chat" else 0)
    assert done.output_tokens_per_s == pytest.approx(5 / (done.e2e_s - done.ttft_s))


def test_stream_without_usage_counts_chunks_and_sends_the_key():
    with StubServer(honour_usage=False) as stub:
        done = client.stream_completion(client.Server(stub.url + "/v1/", api_key="k1"), "chat", MODEL, "hello", 4)
        assert stub.state.log[0]["authorization"] == "Bearer k1"
    assert done.prompt_tokens is None and done.completion_tokens is None
    assert done.output_tokens == 4
    with pytest.raises(UsageError, match="not an http"):
        client.Server("127.0.0.1:8000")
    with pytest.raises(UsageError, match="no valid port"):
        client.Server("http://127.0.0.1:notaport")


def test_a_bad_port_is_a_usage_error_on_the_command_line(tmp_path, capsys):
    assert bench(tmp_path, "--url", "http://127.0.0.1:notaport") == 2
    assert "has no valid port" in capsys.readouterr().err


def test_a_stream_must_end_as_a_complete_answer():
    with StubServer() as stub:
        server = client.Server(stub.url)
        stub.fail("abort")
        with pytest.raises(TransientServerError, match="finish_reason 'abort' after 3 text chunk"):
            client.stream_completion(server, "completions", MODEL, "hello", 8)
        stub.fail("bad-utf8")
        with pytest.raises(ServerError, match="not UTF-8"):
            client.stream_completion(server, "completions", MODEL, "hello", 8)
        stub.fail("choices-object")
        with pytest.raises(ServerError, match="choices are not a list"):
            client.stream_completion(server, "chat", MODEL, "hello", 8)
        stub.fail("empty")
        with pytest.raises(TransientServerError, match=r"accepted the request \(200\) and closed its stream without an "
                                                       r"event: it failed the request after accepting it"):  # fmt: skip
            client.stream_completion(server, "completions", MODEL, "hello", 8)
        assert client.stream_completion(server, "chat", MODEL, "hello", 8).finish_reason == "length"
    for reason in ("content_filter", "something-else"):
        with pytest.raises(ServerError, match=f"finish_reason '{reason}'") as failure:
            client.check_finish(reason, "here", 3)
        assert not isinstance(failure.value, TransientServerError)
    with pytest.raises(TransientServerError, match="finish_reason None"):
        client.check_finish(None, "here", 3)


def test_errors_are_classified():
    with StubServer(max_model_len=1000) as stub:
        server = client.Server(stub.url)
        for action in ("500", "503", "429", "drop"):
            stub.fail(action)
            with pytest.raises(TransientServerError):
                client.stream_completion(server, "chat", MODEL, "hello", 8)
        with pytest.raises(ContextTooLong, match="maximum context length is 1000"):
            client.stream_completion(server, "chat", MODEL, "x" * 8000, 8)
        with pytest.raises(ModelNotServed, match="other-model"):
            client.stream_completion(server, "chat", "other-model", "hello", 8)
        with pytest.raises(ModelNotServed, match="it serves: stub-model"):
            client.check_model(server, "other-model")
        assert client.check_model(server, MODEL)["max_model_len"] == 1000
        port = stub.url.rsplit(":", 1)[1]
    with pytest.raises(ServerUnreachable, match="cannot reach"):
        client.served_models(client.Server(f"http://127.0.0.1:{port}"))


# prompts -------------------------------------------------------------------------------------------------


class WordTokenizer:
    """Whitespace tokens, for cutting in tokens without a model."""

    def __call__(self, text, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": text.split()})()

    def decode(self, ids):
        return " ".join(ids)


def test_prompt_text_cuts_in_tokens_or_characters_and_calibrates():
    text = " ".join(f"w{i}" for i in range(5000))
    by_token = PromptText(text, WordTokenizer())
    assert by_token.initial_units(100) == 100
    assert len(by_token.body(100, 3).split()) == 100
    assert by_token.calibrate(100, 100, 112) == 88  # 12 tokens of template and header come off the body
    by_char = PromptText(text)
    assert by_char.initial_units(100) == 360
    assert by_char.calibrate(360, 100, 120) == 300 and by_char.chars_per_token == 3.0
    assert by_char.body(50, 1) != by_char.body(50, 2)
    assert by_char.prompt(50, 1, "tag a") != by_char.prompt(50, 1, "tag b")


def test_parse_lengths():
    assert parse_lengths("4096, 8K,32k") == (4096, 8192, 32768)


# bench -------------------------------------------------------------------------------------------------


def bench(tmp_path, *args):
    return main(["bench", "-q", "--model", MODEL, "--out", str(tmp_path / "out"), *args])


def test_bench_measures_both_servers_interleaved(tmp_path, capsys):
    lengths, repeats = (512, 2048), 4
    with StubServer(ttft_base=0.01, ttft_per_token=4e-5) as base, StubServer(ttft_base=0.01, ttft_per_token=1e-5) as acc:
        code = bench(tmp_path, "--url", acc.url, "--baseline-url", base.url, "--lengths", "512,2K",
                     "--repeats", str(repeats), "--max-tokens", "4")  # fmt: skip
        logs = {"baseline": base.state.log, "accelerated": acc.state.log}
    assert code == 0
    out = tmp_path / "out"
    result = json.loads((out / "results.json").read_text())
    assert result["config"]["lengths"] == list(lengths)
    delays = {"baseline": 4e-5, "accelerated": 1e-5}
    for name, per_token in delays.items():
        server = result["servers"][name]
        assert set(server["lengths"]) == {"512", "2048"}
        for length in lengths:
            row = server["lengths"][str(length)]
            samples = row["ttft_s"]["samples"]
            assert len(samples) == repeats and row["failures"] == []
            # The warm-up calibrated the cut: every timed prompt within 2% of the target length.
            assert all(abs(t - length) <= 0.02 * length for t in row["prompt_tokens"])
            expected = 0.01 + per_token * statistics.median(row["prompt_tokens"])
            assert row["ttft_s"]["median"] == pytest.approx(expected, abs=0.012)
            assert row["ttft_s"]["median"] == statistics.median(samples)
            assert row["ttft_s"]["p90"] == pytest.approx(float(np.percentile(samples, 90)))
            assert row["ttft_s"]["p99"] == pytest.approx(float(np.percentile(samples, 99)))
            assert all(e >= t for e, t in zip(row["e2e_s"]["samples"], samples))
            assert row["output_tokens"] == [4] * repeats
    for length in lengths:
        key = str(length)
        b, a = (result["servers"][n]["lengths"][key]["ttft_s"]["median"] for n in ("baseline", "accelerated"))
        assert result["speedup"][key]["ttft"] == pytest.approx(b / a)
    assert result["speedup"]["2048"]["ttft"] == pytest.approx((0.01 + 4e-5 * 2048) / (0.01 + 1e-5 * 2048), rel=0.2)

    # Interleaving: warm-ups first, then rounds alternating which server goes first.
    timed = [(r["server"][0], r["length"]) for r in result["requests"] if r["repeat"] >= 0]
    assert [s for s, n in timed if n == 512] == list("baab" * 2)
    received = sorted((e["received"], name[0]) for name, log in logs.items() for e in log)
    assert "".join(name for _, name in received) == ("ba" + "baab" * 2) * 2
    # Every prompt is unique, down to its first line (no shared cached prefix).
    prompts = [e["prompt"] for log in logs.values() for e in log]
    assert len({p.split("\n", 1)[0] for p in prompts}) == len(prompts) == 2 * len(lengths) * (1 + repeats)

    table = (out / "results.md").read_text()
    assert table == capsys.readouterr().out.split("Wrote")[0]
    row = next(line for line in table.splitlines() if line.startswith("| 2048 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    base_row = result["servers"]["baseline"]["lengths"]["2048"]["ttft_s"]
    assert cells[2] == " / ".join(f"{base_row[k] * 1e3:.1f}" for k in ("median", "p90", "p99"))
    assert cells[-2] == f"{result['speedup']['2048']['ttft']:.2f}x"
    for png in ("ttft.png", "speedup.png"):
        data = (out / png).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        with Image.open(out / png) as image:
            image.verify()
            assert image.size[0] > 300 and image.size[1] > 200


def test_bench_concurrency_and_single_server(tmp_path):
    with StubServer(ttft_base=0.2, ttft_per_token=0.0) as stub:
        code = bench(tmp_path, "--url", stub.url, "--lengths", "256", "--repeats", "2", "--concurrency", "3",
                     "--api", "completions", "--warmup", "0", "--max-tokens", "2")  # fmt: skip
        received = [e["received"] for e in stub.state.log]
    assert code == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(result["servers"]) == ["accelerated"] and result["speedup"] == {}
    assert len(result["servers"]["accelerated"]["lengths"]["256"]["ttft_s"]["samples"]) == 6
    # Three requests of a round arrive together, the next round after the first has answered.
    assert max(received[:3]) - min(received[:3]) < 0.1 and min(received[3:]) - max(received[:3]) > 0.15
    assert (tmp_path / "out" / "ttft.png").exists() and not (tmp_path / "out" / "speedup.png").exists()


def test_bench_refuses_unserved_model_unreachable_server_and_lengths_over_the_context(tmp_path, capsys):
    with StubServer(max_model_len=1000) as stub:
        assert bench(tmp_path, "--url", stub.url, "--model", "nope") == 2
        assert "does not serve model 'nope'; it serves: stub-model" in capsys.readouterr().err
        assert bench(tmp_path, "--url", stub.url, "--lengths", "512,2048") == 2
        assert "max_model_len 1000: no room for 2048-token prompts" in capsys.readouterr().err
        assert stub.state.log == []
        port = stub.url.rsplit(":", 1)[1]
    assert bench(tmp_path, "--url", f"http://127.0.0.1:{port}") == 1
    assert "cannot reach the server" in capsys.readouterr().err


def test_bench_stops_at_a_refused_length_and_keeps_what_ran(tmp_path, capsys):
    with StubServer(max_model_len=1500, advertise_max_model_len=False) as stub:
        code = bench(tmp_path, "--url", stub.url, "--lengths", "512,2048,4096", "--repeats", "1", "--max-tokens", "2")
    assert code == 1
    assert "longer than the server accepts" in capsys.readouterr().err
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(result["servers"]["accelerated"]["lengths"]) == ["512"]
    assert "maximum context length is 1500" in result["error"]
    assert "Stopped:" in (tmp_path / "out" / "results.md").read_text()


def test_bench_sends_each_key_only_to_its_own_server(tmp_path):
    with StubServer() as base, StubServer() as acc:
        args = ("--url", acc.url, "--baseline-url", base.url, "--lengths", "256", "--repeats", "1", "--max-tokens", "2",
                "--no-plots")  # fmt: skip
        assert bench(tmp_path, *args, "--api-key", "secret-a") == 0
        assert {e["authorization"] for e in acc.state.log} == {"Bearer secret-a"}
        assert {e["authorization"] for e in base.state.log} == {None}
        acc.state.log.clear()
        base.state.log.clear()
        assert bench(tmp_path, *args, "--api-key", "secret-a", "--baseline-api-key", "secret-b") == 0
        assert {e["authorization"] for e in acc.state.log} == {"Bearer secret-a"}
        assert {e["authorization"] for e in base.state.log} == {"Bearer secret-b"}
    text = (tmp_path / "out" / "results.json").read_text()
    assert "secret-a" not in text and "secret-b" not in text


def test_bench_counts_an_aborted_answer_as_a_failure(tmp_path):
    with StubServer() as stub:
        stub.fail("abort", when="accelerated 512 0 ")
        code = bench(tmp_path, "--url", stub.url, "--lengths", "512", "--repeats", "2", "--max-tokens", "4")
    assert code == 1
    row = json.loads((tmp_path / "out" / "results.json").read_text())["servers"]["accelerated"]["lengths"]["512"]
    assert len(row["ttft_s"]["samples"]) == 1 and "finish_reason 'abort'" in row["failures"][0]


def test_quiet_goes_before_or_after_the_command(capsys):
    assert main(["-q", "targets"]) == 0
    assert main(["targets", "-q"]) == 0
    assert "vllm-0.26.0" in capsys.readouterr().out


def test_bench_counts_failed_requests(tmp_path):
    with StubServer() as stub:
        stub.fail("503", times=1)
        stub.state.failures[0].when = "accelerated 512 1 "  # the second timed round
        code = bench(tmp_path, "--url", stub.url, "--lengths", "512", "--repeats", "3", "--max-tokens", "2")
    assert code == 1
    row = json.loads((tmp_path / "out" / "results.json").read_text())["servers"]["accelerated"]["lengths"]["512"]
    assert row["requests"] == 3 and len(row["ttft_s"]["samples"]) == 2
    assert len(row["failures"]) == 1 and "HTTP 503" in row["failures"][0]


def test_bench_corpus_file(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("short text")
    with StubServer() as stub:
        assert bench(tmp_path, "--url", stub.url, "--lengths", "512", "--corpus", str(corpus), "--no-plots") == 2
        assert "too few" in capsys.readouterr().err
        corpus.write_text(" ".join(f"lighthouse{i}" for i in range(3000)))
        assert bench(tmp_path, "--url", stub.url, "--lengths", "512", "--corpus", str(corpus), "--repeats", "1",
                     "--no-plots", "--max-tokens", "2") == 0  # fmt: skip
        assert all("lighthouse" in e["prompt"] for e in stub.state.log)
    assert not (tmp_path / "out" / "ttft.png").exists()


def test_bench_leaves_room_for_the_output_at_max_model_len(tmp_path, capsys):
    with StubServer(max_model_len=1024) as stub:
        code = main(["bench", "--model", MODEL, "--out", str(tmp_path / "out"), "--url", stub.url, "--lengths",
                     "512,1K", "--repeats", "2", "--max-tokens", "8", "--no-plots"])  # fmt: skip
        refused = [e for e in stub.state.log if e["outcome"] != "ok"]
    assert code == 0 and refused == []
    assert "1024: prompts of 995 tokens, leaving room for 8 output tokens and a 2% margin" in capsys.readouterr().err
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["prompt_tokens_target"] == {"512": 512, "1024": 995}  # (1024 - 8) * 0.98
    assert all(975 <= t <= 1016 for t in result["servers"]["accelerated"]["lengths"]["1024"]["prompt_tokens"])


def test_bench_says_when_lengths_cannot_be_calibrated(tmp_path, capsys):
    with StubServer(honour_usage=False) as stub:
        assert main(["bench", "--model", MODEL, "--out", str(tmp_path / "out"), "--url", stub.url, "--lengths", "512",
                     "--repeats", "1", "--no-plots"]) == 0  # fmt: skip
    assert "sent no usage.prompt_tokens: prompt lengths are first guesses" in capsys.readouterr().err
    row = json.loads((tmp_path / "out" / "results.json").read_text())["servers"]["accelerated"]["lengths"]["512"]
    assert row["prompt_tokens"] == [None]
