"""The key directory a vLLM node shares with its connector's processes (vllm_backend/
handshake.py): the connector's copy follows the node's file and, on a miss, makes the node ask
its authority first. No vLLM here: the node's side and the copy in one process, as the node
and vLLM's worker use them."""

from __future__ import annotations

import time

import pytest

from pdcluster.core.identity import Directory, Peer
from pdcluster.vllm_backend import handshake
from pdcluster.vllm_backend.handshake import DirectoryServer, Handshake, read_directory


def _peer(name: str, port: int) -> Peer:
    return Peer(f"node:{name}", f"{name:x<40}".encode(), f"tcp://127.0.0.1:{port}",
                f"tcp://127.0.0.1:{port + 1}", f"127.0.0.1:{port + 2}", b"")


class Node:
    """A node's directory over an authority the test edits, copied into a handshake folder."""

    def __init__(self, serve: bool = True) -> None:
        self.registered = [_peer("p0", 5000)]
        self.asked = 0
        self.directory = Directory(refresh=self._authority)
        self.directory.refresh_now(force=True)
        self.handshake = Handshake()
        self.directory.subscribe(self.handshake.write_peers)
        self.server = DirectoryServer(self.handshake.dir, self.directory) if serve else None

    def _authority(self) -> list[Peer]:
        self.asked += 1
        return list(self.registered)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.handshake.close()


@pytest.fixture
def node():
    running = Node()
    yield running
    running.close()


def test_a_node_registered_after_the_last_refresh_is_found_at_once(node) -> None:
    copy = read_directory(node.handshake.dir)
    assert copy is not None
    try:
        late = _peer("p1", 6000)
        node.registered.append(late)  # the node's own refresh (every 2 s) has not run since
        started = time.monotonic()
        assert copy.by_kv_address(late.kv_address) == late
        assert copy.server_key_for(late.kv_address) == late.public_key
        assert time.monotonic() - started < 1.0
    finally:
        copy.close()


def test_strangers_cost_the_authority_one_call_per_refresh_interval(node) -> None:
    copy = read_directory(node.handshake.dir)
    assert copy is not None
    try:
        before = node.asked
        started = time.monotonic()
        for i in range(5):
            assert copy.by_kv_address(f"tcp://127.0.0.1:{7000 + i}") is None
        elapsed = time.monotonic() - started
        # the node's directory refreshes at most once per 0.2 s, however many misses
        assert node.asked - before <= elapsed / 0.2 + 1, (node.asked - before, elapsed)
    finally:
        copy.close()


def test_a_node_that_does_not_answer_costs_a_miss_its_timeout_not_a_hang(monkeypatch) -> None:
    monkeypatch.setattr(handshake, "ASK_TIMEOUT_S", 0.3)
    silent = Node(serve=False)
    copy = read_directory(silent.handshake.dir)
    assert copy is not None
    try:
        started = time.monotonic()
        assert copy.by_kv_address("tcp://127.0.0.1:9999") is None
        assert 0.3 <= time.monotonic() - started < 1.5
        known = silent.registered[0]
        assert copy.by_kv_address(known.kv_address) == known  # what the file holds still serves
    finally:
        copy.close()
        silent.close()
