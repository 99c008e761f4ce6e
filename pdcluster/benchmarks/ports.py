"""A free port for a server that a benchmark or a test starts and then addresses.

Such a port is picked before the server binds it, and in between any process may take it. A
port the kernel hands out for `bind(..., 0)` comes from its ephemeral range, the same range
from which it picks every outgoing connection's local port and every other `bind(..., 0)`'s
port (Ray's gRPC servers, ZMQ, Mooncake's data sockets): with Ray starting processes in that
gap, a chaos run once found its router's port held by a Ray gRPC server. `free_port` therefore
picks at random below that range and above the ranges of what the harnesses run (Ray's worker
ports, 10002-19999 by default; Mooncake's RPC and data ports, seen between 15000 and 17000),
where only an explicit bind can take a port, and checks that it is free now.

API: `free_port()`.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
LOWEST = 20_000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 200
_pick = random.SystemRandom()  # not `random`: a test that seeds it must not repeat our picks


def free_port() -> int:
    """A port of 127.0.0.1 that nothing holds now, below the kernel's ephemeral range where
    the range leaves room there; inside it (the kernel's choice) otherwise."""
    top = min(_ephemeral_start(), 65_536)
    if top - LOWEST < 1_000:
        return _kernel_port()
    for _ in range(_TRIES):
        port = _pick.randrange(LOWEST, top)
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port on {HOST} in {LOWEST}-{top - 1} after {_TRIES} tries")


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _kernel_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])
