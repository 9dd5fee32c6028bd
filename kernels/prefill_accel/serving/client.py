"""A streaming client for OpenAI-compatible servers (vLLM, SGLang): `/v1/models`, and
`/v1/chat/completions` or `/v1/completions` with ``stream: true``, timed per request.

Standard library only (http.client), one connection per request, so threads give concurrency.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Iterable, Iterator
from urllib.parse import urlsplit

from .errors import ContextTooLong, ModelNotServed, ServerError, ServerUnreachable, TransientServerError, UsageError

APIS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Words of the HTTP 400 messages vLLM, SGLang and OpenAI give for a prompt over the context length.
CONTEXT_ERROR_WORDS = ("context length", "maximum context", "max_model_len", "context window", "too long",
                       "longer than")  # fmt: skip


@dataclass(frozen=True)
class Server:
    """An OpenAI-compatible server: its base URL (with or without a trailing ``/v1``) and API key."""

    url: str
    api_key: str | None = None
    timeout: float = 600.0

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
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

    def open(self, method: str, path: str, body: dict | None = None):
        """Send one request; returns (connection, response) with the response's headers read, its body not.
        Raises ServerUnreachable."""
        connection = self.connection()
        try:
            connection.request(method, self.base_path + path, body=None if body is None else json.dumps(body),
                               headers=self.headers())  # fmt: skip
            return connection, connection.getresponse()
        except (ConnectionError, socket.timeout, OSError, http.client.HTTPException) as error:
            connection.close()
            raise ServerUnreachable(f"cannot reach the server at {self.url} ({error}); is it running, "
                                    "and is the URL's host and port right?") from error  # fmt: skip


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
        line = raw.decode("utf-8").rstrip("\r\n")
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
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def stream_completion(server: Server, api: str, model: str, prompt: str, max_tokens: int,
                      extra: dict | None = None, on_text=None) -> Completion:  # fmt: skip
    """Send one streamed request and time it. ``on_text(piece)`` is called with each piece of text as it
    arrives. Raises ContextTooLong, ModelNotServed, TransientServerError (retry may help), ServerError."""
    body = request_body(api, model, prompt, max_tokens, extra)
    start = time.perf_counter()
    connection, response = server.open("POST", APIS[api], body)
    what = f"POST {APIS[api]}"
    try:
        if response.status != 200:
            raise_for_status(server, response.status, response.read(), what, model)
        pieces: list[str] = []
        first = None
        chunks = 0
        usage: dict = {}
        finish_reason = None
        done = False
        for data in sse_data(iter(response.readline, b"")):
            if data.strip() == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except ValueError as error:
                raise ServerError(f"{what} at {server.url}: a streamed event is not JSON: {data[:200]!r}") from error
            if "error" in event:
                raise TransientServerError(f"{what} at {server.url}: error in the stream: {error_message(data.encode())}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                piece = chunk_text(api, choice)
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    chunks += 1
                    pieces.append(piece)
                    if on_text is not None:
                        on_text(piece)
                finish_reason = choice.get("finish_reason") or finish_reason
        end = time.perf_counter()
    except (ConnectionError, socket.timeout, http.client.HTTPException) as error:
        raise TransientServerError(f"{what} at {server.url}: the connection broke mid-stream ({error!r})") from error
    finally:
        connection.close()
    if not done and finish_reason is None:
        raise TransientServerError(f"{what} at {server.url}: the stream ended before its last event")
    if first is None:
        raise ServerError(f"{what} at {server.url}: the server streamed no text (finish_reason {finish_reason})")
    return Completion(text="".join(pieces), ttft_s=first - start, e2e_s=end - start, chunks=chunks,
                      prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
                      finish_reason=finish_reason)  # fmt: skip
