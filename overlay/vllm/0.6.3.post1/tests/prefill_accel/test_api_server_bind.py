"""prefill-accel: vLLM 0.6.3's OpenAI server binds the address --host names (patch 0007).

run_server binds its socket before it starts the engine, and uvicorn serves on that socket; upstream
bound every address whatever --host said. The engine is stood in for by one that stops the server as
soon as run_server asks for it, after the bind.
"""

import asyncio
import contextlib
import socket

import pytest

from vllm.entrypoints.openai import api_server
from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils import FlexibleArgumentParser


class Stop(Exception):
    """Raised where the engine would start."""


def bound_by_run_server(monkeypatch, *flags: str) -> list:
    """The addresses run_server binds for these command-line flags."""
    bound = []

    class Recording(socket.socket):
        def bind(self, address):
            bound.append(address)
            return super().bind(address)

    @contextlib.asynccontextmanager
    async def no_engine(args):
        raise Stop
        yield

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(api_server.socket, "socket", Recording)
    monkeypatch.setattr(api_server, "build_async_engine_client", no_engine)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--port", str(port), *flags])
    with pytest.raises(Stop):
        asyncio.run(api_server.run_server(args))
    return [(host, bound_port - port) for host, bound_port in bound]


def test_the_server_socket_is_bound_to_host(monkeypatch):
    assert bound_by_run_server(monkeypatch, "--host", "127.0.0.1") == [("127.0.0.1", 0)]


def test_without_host_the_server_socket_takes_every_address(monkeypatch):
    assert bound_by_run_server(monkeypatch) == [("", 0)]
