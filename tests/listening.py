"""The TCP sockets processes listen on, read from /proc (Linux): for tests that check what a server,
an image or torch.distributed's store exposes beyond loopback."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def listening_sockets(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets in LISTEN state that these processes hold. (A socket bound but
    not yet listening is in no /proc table: port_taken finds those.)"""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:
                address, port = fields[1].split(":")
                found.add((_address(address), int(port, 16)))
    return found


def _address(hex_address: str) -> str:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    return str(ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
