"""A local OpenAI-compatible server for the serving tools' tests: real HTTP, real SSE streaming.

It serves one model on ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions``. A prompt counts one
token per ``chars_per_token`` characters (plus ``chat_overhead`` for the chat template). The first text
arrives ``ttft_base + ttft_per_token * prompt_tokens`` seconds after the request (a role-only chat chunk and
a keep-alive comment are sent at once, before it, as servers do), then one token every ``itl`` seconds.
The answer is deterministic: ``answer(prompt, n)``. Failures are queued with ``fail(action, when=..., times=...)``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def answer_pieces(prompt: str, count: int) -> list[str]:
    """What the stub streams for ``prompt``: a digest of the prompt, then numbered tokens."""
    digest = hashlib.sha1(prompt.encode()).hexdigest()[:10]
    return [f"{digest} "] + [f"t{i} " for i in range(1, count)]


def answer(prompt: str, count: int) -> str:
    return "".join(answer_pieces(prompt, count))


@dataclass
class Failure:
    action: str
    """"500", "503", "429" (that HTTP status), "drop" (close the connection after two tokens), "abort" (end the
    stream after two tokens with finish_reason "abort", as vLLM does for a request it dropped), "bad-utf8" (an
    event that is not UTF-8 after two tokens), "choices-object" (an event whose choices are an object), "empty"
    (the 200 header, then the stream's end without an event, as vLLM 0.6.3's server did for a request it failed
    after accepting it)."""
    when: str | None
    """Only prompts containing this text (None: any prompt)."""
    times: int


@dataclass
class StubState:
    model: str = "stub-model"
    max_model_len: int | None = 200_000
    advertise_max_model_len: bool = True
    """Put max_model_len on the model card (vLLM does); False: refuse long prompts only when they come."""
    chars_per_token: int = 4
    chat_overhead: int = 7
    ttft_base: float = 0.0
    ttft_per_token: float = 0.0
    itl: float = 0.0
    honour_usage: bool = True
    failures: list[Failure] = field(default_factory=list)
    log: list[dict] = field(default_factory=list)
    """Every completion request: path, model, prompt, prompt_tokens, time received, outcome."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def prompt_tokens(self, path: str, prompt: str) -> int:
        return len(prompt) // self.chars_per_token + (self.chat_overhead if "chat" in path else 0)

    def take_failure(self, prompt: str) -> str | None:
        with self.lock:
            for failure in self.failures:
                if failure.times > 0 and (failure.when is None or failure.when in prompt):
                    failure.times -= 1
                    return failure.action
        return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: StubState

    def log_message(self, *args) -> None:
        pass

    def send_json(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def error(self, status: int, message: str, kind: str) -> None:
        self.send_json(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})

    def chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def event(self, payload) -> None:
        self.chunk(b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n")

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/v1/models":
            return self.error(404, f"no route {self.path}", "NotFoundError")
        card = {"id": self.state.model, "object": "model", "owned_by": "stub"}
        if self.state.max_model_len is not None and self.state.advertise_max_model_len:
            card["max_model_len"] = self.state.max_model_len
        self.send_json(200, {"object": "list", "data": [card]})

    def do_POST(self) -> None:
        state = self.state
        received = time.perf_counter()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            return self.error(404, f"no route {self.path}", "NotFoundError")
        prompt = "".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        tokens = state.prompt_tokens(self.path, prompt)
        entry = {"path": self.path, "model": body.get("model"), "prompt": prompt, "prompt_tokens": tokens,
                 "received": received, "max_tokens": body["max_tokens"], "authorization": self.headers.get("Authorization")}
        with state.lock:
            state.log.append(entry)
        if body.get("model") != state.model:
            entry["outcome"] = "404"
            return self.error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        if state.max_model_len is not None and tokens + body["max_tokens"] > state.max_model_len:
            entry["outcome"] = "400"
            return self.error(400, f"This model's maximum context length is {state.max_model_len} tokens. However, "
                              f"you requested {tokens + body['max_tokens']} tokens ({tokens} in the messages, "
                              f"{body['max_tokens']} in the completion). Please reduce the length.", "BadRequestError")
        action = state.take_failure(prompt)
        entry["outcome"] = action or "ok"
        if action in ("500", "503", "429"):
            return self.error(int(action), "stub failure", "InternalServerError")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if action == "empty":
            return self.chunk(b"")
        base = {"id": "cmpl-stub", "created": int(time.time()), "model": state.model}
        if chat:
            self.event({**base, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        self.chunk(b": keep-alive\n\n")
        time.sleep(max(0.0, received + state.ttft_base + state.ttft_per_token * tokens - time.perf_counter()))
        pieces = answer_pieces(prompt, body["max_tokens"])
        for i, piece in enumerate(pieces):
            if i and state.itl:
                time.sleep(state.itl)
            if action == "drop" and i == 2:
                self.wfile.flush()
                self.connection.shutdown(2)
                self.close_connection = True
                return
            if action == "bad-utf8" and i == 2:
                self.event(b'{"choices": [{"index": 0, "text": "\xff\xfe"}]}')
            if action == "choices-object" and i == 2:
                self.event({**base, "choices": {"index": 0, "text": piece}})
            last = i == len(pieces) - 1 or (action == "abort" and i == 2)
            choice = {"index": 0, "finish_reason": ("abort" if action == "abort" else "length") if last else None}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            self.event({**base, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]})
            if last:
                break
        if state.honour_usage and (body.get("stream_options") or {}).get("include_usage"):
            self.event({**base, "choices": [], "usage": {"prompt_tokens": tokens, "completion_tokens": len(pieces),
                                                           "total_tokens": tokens + len(pieces)}})
        self.event(b"[DONE]")
        self.chunk(b"")


class StubServer:
    """``with StubServer(ttft_per_token=1e-5) as stub: stub.url``; ``stub.state`` is live. Port 0 picks a free one."""

    def __init__(self, port: int = 0, **settings):
        self.state = StubState(**settings)
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def fail(self, action: str, when: str | None = None, times: int = 1) -> None:
        self.state.failures.append(Failure(action, when, times))

    def __enter__(self) -> "StubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Serve the stub on 127.0.0.1 until interrupted (to try the "
                                     "serving tools without a GPU).")  # fmt: skip
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="stub-model")
    parser.add_argument("--max-model-len", type=int, default=200_000)
    parser.add_argument("--ttft-base", type=float, default=0.0, help="seconds before the first token")
    parser.add_argument("--ttft-per-token", type=float, default=0.0, help="more seconds per prompt token")
    parser.add_argument("--itl", type=float, default=0.0, help="seconds between output tokens")
    args = parser.parse_args()
    with StubServer(args.port, model=args.model, max_model_len=args.max_model_len, ttft_base=args.ttft_base,
                    ttft_per_token=args.ttft_per_token, itl=args.itl) as stub:  # fmt: skip
        print(f"stub serving {args.model} at {stub.url}", flush=True)
        try:
            stub.thread.join()
        except KeyboardInterrupt:
            pass
