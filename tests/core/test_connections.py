"""Closing departed keys' connections (core/connections.py) on real CURVE sockets: when the
directory drops a key, its noted connections are shut down and the client's reconnect is
refused by ZAP, while another member's connection lives on; a descriptor that no longer is the
noted TCP connection is left alone."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from pdcluster.core.connections import PeerConnections
from pdcluster.core.credentials import CurveKeys
from pdcluster.core.curve import authenticator_for, secure_server, stop_authenticator
from pdcluster.core.identity import Directory, Peer
from tests.core.test_zap import client, received


@pytest.fixture
def served() -> Iterator[tuple[zmq.Context, zmq.Socket, CurveKeys, list[Peer], Directory]]:
    context: zmq.Context = zmq.Context()
    registry: list[Peer] = []
    directory = Directory(refresh=lambda: list(registry), min_refresh_s=0.0, grace_s=0.0)
    server_keys = CurveKeys.generate()
    server = context.socket(zmq.ROUTER)
    secure_server(server, server_keys, directory)
    server.bind("tcp://127.0.0.1:0")
    try:
        yield context, server, server_keys, registry, directory
    finally:
        server.close(linger=0)
        stop_authenticator(context)
        context.term()


def _member(context, server, server_keys, registry, directory, principal: str):
    keys = CurveKeys.generate()
    registry.append(Peer(principal, keys.public))
    directory.refresh_now(force=True)
    sock = client(context, server, server_keys, keys)
    return keys, sock


def test_a_departed_keys_connection_is_closed_and_others_live_on(served) -> None:
    context, server, server_keys, registry, directory = served
    connections = PeerConnections(server, directory)
    _, gone = _member(context, server, server_keys, registry, directory, "node/gone")
    _, stays = _member(context, server, server_keys, registry, directory, "node/stays")
    for sock, principal in ((gone, "node/gone"), (stays, "node/stays")):
        sock.send(b"hello")
        frames = received(server, 5.0)
        assert frames is not None and connections.principal(frames[-1]) == principal
    monitor = gone.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    denied = authenticator_for(context).num_denied
    del registry[0]
    directory.refresh_now(force=True)
    assert connections.num_closed == 1
    assert monitor.poll(5_000), "the departed key's connection was not closed"
    gone.send(b"still here?")
    assert received(server, 1.0) is None  # its reconnect is refused
    assert authenticator_for(context).num_denied > denied
    stays.send(b"still here")
    frames = received(server, 5.0)
    assert frames is not None and connections.principal(frames[-1]) == "node/stays"
    gone.disable_monitor()
    monitor.close(linger=0)
    connections.close()
    for sock in (gone, stays):
        sock.close()


def test_a_descriptor_that_is_another_connection_now_is_left_alone(served) -> None:
    context, server, server_keys, registry, directory = served
    connections = PeerConnections(server, directory)
    _, sock = _member(context, server, server_keys, registry, directory, "node/a")
    sock.send(b"hello")
    frames = received(server, 5.0)
    assert frames is not None and connections.principal(frames[-1]) == "node/a"
    fd = frames[-1].get(zmq.SRCFD)
    key, _ = connections._by_fd[fd]
    connections._by_fd[fd] = (key, ("127.0.0.1", 1))  # as if the number had been reused
    del registry[0]
    directory.refresh_now(force=True)
    assert connections.num_closed == 0 and fd not in connections._by_fd
    connections.close()
    sock.close()
