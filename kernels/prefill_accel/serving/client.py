"""A streaming client for OpenAI-compatible servers (vLLM, SGLang): `/v1/models`, and
`/v1/chat/completions` or `/v1/completions` with ``stream: true``, timed per request.

Standard library only (http.client), one connection per request, so threads give concurrency.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator
from urllib.parse import urlsplit

from .errors import (Cancelled, ContextTooLong, ModelNotServed, ServerError, ServerUnreachable, TransientServerError,
                     UsageError)

APIS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Words of the HTTP 400 messages vLLM, SGLang and OpenAI give for a prompt over the context length.
CONTEXT_ERROR_WORDS = ("context length", "maximum context", "max_model_len", "context window", "too long",
                       "longer than")  # fmt: skip
COMPLETE_FINISH_REASONS = ("stop", "length", "tool_calls")
"""Finish reasons of an answer the server ended as it meant to; vLLM and SGLang say "abort" for one they dropped."""


@dataclass(frozen=True)
class Server:
    """An OpenAI-compatible server: its base URL (with or without a trailing ``/v1``) and API key."""

    url: str
    api_key: str | None = None
    timeout: float = 600.0

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        try:
            parts.port
        except ValueError as error:
            raise UsageError(f"server URL {self.url!r} has no valid port ({error}); "
                             "give one like http://127.0.0.1:8000") from None  # fmt: skip
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"server URL {self.url!r} is not an http(s) URL like http://127.0.0.1:8000")

    @property
    def base_path(self) -> str:
        path = urlsplit(self.url).path.rstrip("/")
        return path.removesuffix("/v1")

    def connection(self) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        return cls(parts.hostname, parts.port, timeout=self.timeout)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def open(self, method: str, path: str, body: dict | None = None, cancel: "Cancel | None" = None):
        """Send one request; returns (connection, response) with the response's headers read, its body not.
        Raises ServerUnreachable, or Cancelled once ``cancel`` is set."""
        connection = self.connection()
        try:
            connection.connect()  # before registering, so a cancel always finds the socket to shut
            if cancel is not None:
                cancel.register(connection)
            connection.request(method, self.base_path + path, body=None if body is None else json.dumps(body),
                               headers=self.headers())  # fmt: skip
            return connection, connection.getresponse()
        except Cancelled:
            connection.close()
            raise
        except (ConnectionError, socket.timeout, OSError, http.client.HTTPException) as error:
            connection.close()
            if cancel is not None:
                cancel.unregister(connection)
                cancel.check()
            raise ServerUnreachable(f"cannot reach the server at {self.url} ({error}); is it running, "
                                    "and is the URL's host and port right?") from error  # fmt: skip


class Cancel:
    """Stops the requests of a run from another thread: ``cancel()`` shuts the sockets of the requests in
    flight, so a worker blocked reading a stream wakes at once, and no new request starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connections: set[http.client.HTTPConnection] = set()
        self._event = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> None:
        """Sleep for ``seconds``, or less once cancelled (a retry's backoff)."""
        self._event.wait(seconds)

    def register(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            self.check()
            self._connections.add(connection)

    def unregister(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def check(self) -> None:
        if self.cancelled:
            raise Cancelled("the run was interrupted")

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            for connection in self._connections:
                if connection.sock is not None:
                    try:
                        connection.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # already closed by its worker


@dataclass
class Completion:
    """One streamed request, timed from just before the request is sent."""

    text: str
    ttft_s: float
    """Until the first chunk carrying generated text."""
    e2e_s: float
    """Until the end of the stream."""
    chunks: int
    """Streamed chunks that carried text."""
    prompt_tokens: int | None
    """From the server's ``usage``; None when it sent none."""
    completion_tokens: int | None
    finish_reason: str | None

    @property
    def output_tokens(self) -> int:
        """The server's count of generated tokens, else the number of text chunks (one token each on vLLM
        and SGLang)."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def output_tokens_per_s(self) -> float | None:
        """Decode speed: tokens after the first over the time after the first; None with one token or less."""
        if self.output_tokens < 2 or self.e2e_s <= self.ttft_s:
            return None
        return (self.output_tokens - 1) / (self.e2e_s - self.ttft_s)


def sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The ``data`` of each server-sent event: ``data:`` lines joined by newlines, an event ending at a blank
    line; comment lines (``:``) and other fields are skipped."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")  # UnicodeDecodeError: the caller names the server
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def error_message(body: bytes) -> str:
    """The message of an error response: OpenAI's ``{"error": {"message"}}``, vLLM/SGLang's ``{"message"}``,
    FastAPI's ``{"detail"}``, else the text."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:500] or "(empty body)"
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if payload.get(key):
                return str(payload[key])
    return text[:500]


def raise_for_status(server: Server, status: int, body: bytes, what: str, model: str | None = None) -> None:
    """Turn an HTTP error into the error the tools report."""
    message = error_message(body)
    where = f"{what} at {server.url}"
    if status == 400 and any(word in message.lower() for word in CONTEXT_ERROR_WORDS):
        raise ContextTooLong(f"{where}: the prompt is longer than the server accepts: {message}")
    if status == 404 and model is not None and "model" in message.lower():
        raise ModelNotServed(f"{where}: model {model!r} is not served: {message}")
    if status in (401, 403):
        raise ServerError(f"{where}: HTTP {status} {message}; pass the server's key with --api-key")
    if status == 429 or status >= 500:
        raise TransientServerError(f"{where}: HTTP {status} {message}")
    raise ServerError(f"{where}: HTTP {status} {message}")


def served_models(server: Server) -> list[dict]:
    """The model cards of ``GET /v1/models`` (vLLM's carry ``max_model_len``)."""
    connection, response = server.open("GET", "/v1/models")
    try:
        body = response.read()
    finally:
        connection.close()
    if response.status != 200:
        raise_for_status(server, response.status, body, "GET /v1/models")
    try:
        return list(json.loads(body)["data"])
    except (ValueError, KeyError, TypeError) as error:
        raise ServerError(f"GET /v1/models at {server.url} did not return an OpenAI model list: "
                          f"{body[:200]!r}") from error  # fmt: skip


def check_model(server: Server, model: str) -> dict:
    """The card of ``model`` on ``server``; ModelNotServed naming the models it does serve."""
    cards = served_models(server)
    for card in cards:
        if card.get("id") == model:
            return card
    names = ", ".join(str(card.get("id")) for card in cards) or "none"
    raise ModelNotServed(f"the server at {server.url} does not serve model {model!r}; it serves: {names}")


def request_body(api: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    """A streamed request of ``api`` ("chat" or "completions") asking for usage in the last chunk."""
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    elif api == "completions":
        body["prompt"] = prompt
    else:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    body.update(extra or {})
    return body


def chunk_text(api: str, choice: dict) -> str:
    if api == "chat":
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise ValueError(f"delta is {type(delta).__name__}, not an object")
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def event_choices(event) -> list[dict]:
    """The choices of a streamed event, checked to be what the OpenAI API says (ValueError otherwise)."""
    if not isinstance(event, dict):
        raise ValueError(f"the event is a JSON {type(event).__name__}, not an object")
    choices = event.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(choice, dict) for choice in choices):
        raise ValueError("its choices are not a list of objects")
    if not isinstance(event.get("usage") or {}, dict):
        raise ValueError("its usage is not an object")
    return choices


def check_finish(finish_reason: str | None, where: str, chunks: int) -> None:
    """Raise unless the stream ended as a complete answer does (``stop``, ``length``, ``tool_calls``)."""
    if finish_reason in COMPLETE_FINISH_REASONS:
        return
    said = f"{where}: the stream ended with finish_reason {finish_reason!r} after {chunks} text chunk(s)"
    if finish_reason in (None, "abort"):  # the server dropped the request (shutdown, preemption): may pass
        raise TransientServerError(f"{said}; the answer is incomplete")
    raise ServerError(f"{said}; the answer is not complete")


def stream_completion(server: Server, api: str, model: str, prompt: str, max_tokens: int,
                      extra: dict | None = None, on_text=None, cancel: Cancel | None = None) -> Completion:  # fmt: skip
    """Send one streamed request and time it. ``on_text(piece)`` is called with each piece of text as it
    arrives. Raises ContextTooLong, ModelNotServed, TransientServerError (retry may help), ServerError, and
    Cancelled once ``cancel`` is set. Only a stream that ends as a complete answer returns."""
    body = request_body(api, model, prompt, max_tokens, extra)
    start = time.perf_counter()
    connection, response = server.open("POST", APIS[api], body, cancel)
    what = f"POST {APIS[api]}"
    where = f"{what} at {server.url}"
    try:
        if response.status != 200:
            raise_for_status(server, response.status, response.read(), what, model)
        pieces: list[str] = []
        first = None
        chunks = 0
        usage: dict = {}
        finish_reason = None
        done = False
        any_event = False
        for data in sse_data(iter(response.readline, b"")):
            any_event = True
            if data.strip() == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except ValueError as error:
                raise ServerError(f"{where}: a streamed event is not JSON: {data[:200]!r}") from error
            if isinstance(event, dict) and "error" in event:
                raise TransientServerError(f"{where}: error in the stream: {error_message(data.encode())}")
            try:
                choices = event_choices(event)
                if event.get("usage"):
                    usage = event["usage"]
                for choice in choices:
                    piece = chunk_text(api, choice)
                    if piece:
                        if first is None:
                            first = time.perf_counter()
                        chunks += 1
                        pieces.append(piece)
                        if on_text is not None:
                            on_text(piece)
                    finish_reason = choice.get("finish_reason") or finish_reason
            except ValueError as error:
                raise ServerError(f"{where}: a streamed event is not an OpenAI chunk ({error}): {data[:200]!r}") from None
        end = time.perf_counter()
    except UnicodeDecodeError as error:
        raise ServerError(f"{where}: the stream is not UTF-8 ({error})") from None
    except (ConnectionError, socket.timeout, OSError, http.client.HTTPException) as error:
        if cancel is not None:
            cancel.check()
        raise TransientServerError(f"{where}: the connection broke mid-stream ({error!r})") from error
    finally:
        connection.close()
        if cancel is not None:
            cancel.unregister(connection)
    if cancel is not None:
        cancel.check()
    if not done and finish_reason is None:
        if not any_event:
            raise TransientServerError(f"{where}: the server accepted the request (200) and closed its stream without "
                                       "an event: it failed the request after accepting it (the server's log says why)")  # fmt: skip
        raise TransientServerError(f"{where}: the stream ended before its last event")
    if first is None:
        raise ServerError(f"{where}: the server streamed no text (finish_reason {finish_reason})")
    check_finish(finish_reason, where, chunks)
    return Completion(text="".join(pieces), ttft_s=first - start, e2e_s=end - start, chunks=chunks,
                      prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
                      finish_reason=finish_reason)  # fmt: skip
