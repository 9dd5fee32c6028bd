"""torch.distributed's store on loopback, for an engine whose processes all run on one machine.

An engine that initialises torch.distributed at ``tcp://127.0.0.1:PORT`` still gets a store server
listening on every address: torch binds its TCPStore server to ``::`` (or ``0.0.0.0``) whatever host the
init method names. The store is unauthenticated, and nothing off the machine needs it when every rank
runs on it. loopback_store() makes the store for such an init method with its server on the named
loopback address alone (torch takes a listening socket through ``master_listen_fd``), for the engine to
pass to ``torch.distributed.init_process_group(store=...)``.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from urllib.parse import urlsplit

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""torch.distributed's own default for a process group's store when the engine names none."""


def loopback_address(init_method: str | None) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://`` init method whose host is a loopback address; None for any other."""
    if not init_method:
        return None
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        return None
    try:
        loopback = ipaddress.ip_address(parts.hostname).is_loopback
    except ValueError:  # a host name: where it resolves is the machine's business
        return None
    return (parts.hostname, parts.port) if loopback else None


def loopback_store(init_method: str | None, world_size: int, rank: int, timeout: datetime.timedelta | None = None):
    """A ``torch.distributed.TCPStore`` for ``init_method`` whose server (rank 0) listens on its loopback
    address alone; None when ``init_method`` is not ``tcp://`` on a loopback address (use it as given).
    Rank 0 binds and listens before handing the socket to torch; the other ranks connect as clients."""
    address = loopback_address(init_method)
    if address is None:
        return None
    import torch.distributed as dist

    host, port = address
    timeout = timeout or DEFAULT_TIMEOUT
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen()
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                              master_listen_fd=listener.fileno(), use_libuv=True)  # fmt: skip
    except BaseException:
        listener.close()
        raise
    # torch's server now owns the listening descriptor: the Python object must not close it.
    listener.detach()
    return store
