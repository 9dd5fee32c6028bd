"""prefill-accel: on one node, torch.distributed's store stays on loopback.

torch binds a TCPStore server to every address whatever host the init method names; patch 0006 makes
SGLang's init method name 127.0.0.1 on one node and hands init_process_group a store from
prefill_accel.engine.network, whose server listens there alone (the runtime's tests read the listening
sockets; here, that SGLang takes that store and leaves other init methods as they were).
"""

import argparse
import socket

import pytest
import torch
import torch.distributed

from sglang.srt.distributed import bootstrap, parallel_state
from sglang.srt.server_args import ServerArgs


class Stop(Exception):
    """Raised by the stand-in for init_process_group once its arguments are recorded."""


def server_args(*flags: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "dummy", *flags]))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_arguments(monkeypatch, init_method: str) -> dict:
    """What init_distributed_environment hands torch.distributed.init_process_group for one rank."""
    recorded = {}

    def record(**kwargs):
        recorded.update(kwargs)
        raise Stop

    monkeypatch.setattr(torch.distributed, "init_process_group", record)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(Stop):
        parallel_state.init_distributed_environment(world_size=1, rank=0, distributed_init_method=init_method,
                                                    backend="gloo", timeout=30)  # fmt: skip
    return recorded


def test_one_node_names_loopback_whatever_host_serves_the_api(monkeypatch):
    monkeypatch.delenv("SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE", raising=False)
    args = server_args("--host", "0.0.0.0")
    assert bootstrap._resolve_dist_init_method(server_args=args, dist_port=29511) == "tcp://127.0.0.1:29511"
    args.nnodes = 2  # several nodes: the address stays the one the user gave
    assert bootstrap._resolve_dist_init_method(server_args=args, dist_port=29511) == "tcp://0.0.0.0:29511"


def test_a_loopback_init_method_hands_torch_a_store_on_loopback(monkeypatch):
    port = free_port()
    kwargs = init_arguments(monkeypatch, f"tcp://127.0.0.1:{port}")
    store = kwargs["store"]
    assert kwargs["init_method"] is None and isinstance(store, torch.distributed.TCPStore)
    assert (store.host, store.port) == ("127.0.0.1", port)
    store.set("rank0", "ready")
    assert store.get("rank0") == b"ready"


def test_other_init_methods_reach_torch_as_given(monkeypatch):
    kwargs = init_arguments(monkeypatch, "tcp://10.0.0.5:29512")
    assert kwargs["init_method"] == "tcp://10.0.0.5:29512" and kwargs["store"] is None
