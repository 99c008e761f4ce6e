"""The harnesses' port picker (benchmarks/ports.py): below the kernel's ephemeral range, where
no process's `bind(..., 0)` or outgoing connection takes a port between the pick and the
server's bind, and never a port something holds."""

from __future__ import annotations

import socket

from pdcluster.benchmarks import ports
from pdcluster.benchmarks.ports import free_port


def _ephemeral_start() -> int:
    return int(ports._EPHEMERAL.read_text().split()[0])


def test_a_picked_port_lies_below_the_ephemeral_range_and_is_free() -> None:
    start = _ephemeral_start()
    for _ in range(20):
        port = free_port()
        assert ports.LOWEST <= port < start
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


class _Picks:
    def __init__(self, *ports: int) -> None:
        self.ports = list(ports)

    def randrange(self, low: int, high: int) -> int:
        return self.ports.pop(0)


def test_a_port_something_listens_on_is_not_picked(monkeypatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        other = free_port()
        monkeypatch.setattr(ports, "_pick", _Picks(taken, other))
        assert free_port() == other


def test_without_room_below_the_range_the_kernel_picks(monkeypatch, tmp_path) -> None:
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{ports.LOWEST + 10}\t60999\n")
    start = _ephemeral_start()
    monkeypatch.setattr(ports, "_EPHEMERAL", narrow)
    monkeypatch.setattr(ports, "_pick", _Picks())  # a pick from the narrow gap would fail here
    assert free_port() >= start
