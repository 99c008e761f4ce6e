"""The ZAP handler (core/zap.py) on real CURVE sockets: a member's handshake is answered at once
while strangers' keys — each of which waits for a directory refresh before it is refused —
hammer the same socket; a key registered just before its handshake still gets in; a stranger
never does; the member's messages carry its key as User-Id."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.curve import (
    authenticator_for,
    secure_client,
    secure_server,
    sender_principal,
    stop_authenticator,
)
from pdcluster.core.identity import Directory, Peer

MEMBER_PRINCIPAL = "node/d7"
STRANGERS = 12


@pytest.fixture
def served() -> Iterator[tuple[zmq.Context, zmq.Socket, CurveKeys, list[Peer]]]:
    context: zmq.Context = zmq.Context()
    registry: list[Peer] = []
    directory = Directory(refresh=lambda: list(registry), min_refresh_s=0.2)
    authenticator_for(context).follow(directory)
    server_keys = CurveKeys.generate()
    server = context.socket(zmq.ROUTER)
    secure_server(server, server_keys)
    server.bind("tcp://127.0.0.1:0")
    try:
        yield context, server, server_keys, registry
    finally:
        server.close(linger=0)
        stop_authenticator(context)
        context.term()


def client(context: zmq.Context, server: zmq.Socket, server_keys: CurveKeys,
           keys: CurveKeys) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    secure_client(sock, keys, server_keys.public)
    sock.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))
    return sock


def received(server: zmq.Socket, timeout_s: float) -> list[zmq.Frame] | None:
    return server.recv_multipart(copy=False) if server.poll(int(timeout_s * 1000)) else None


def test_a_member_is_admitted_at_once_while_strangers_hammer(served) -> None:
    context, server, server_keys, registry = served
    member = CurveKeys.generate()
    registry.append(Peer(MEMBER_PRINCIPAL, member.public))
    authenticator_for(context).principal_of(member.public)  # the directory knows it now
    strangers = [client(context, server, server_keys, CurveKeys.generate())
                 for _ in range(STRANGERS)]
    for sock in strangers:
        sock.send(b"let me in", zmq.NOBLOCK)
    time.sleep(0.05)  # their handshakes are queued at the handler first
    started = time.monotonic()
    ours = client(context, server, server_keys, member)
    ours.send(b"hello")
    frames = received(server, 5.0)
    admitted_s = time.monotonic() - started
    assert frames is not None and frames[-1].bytes == b"hello"
    assert sender_principal(context, frames[-1]) == MEMBER_PRINCIPAL
    # served before the strangers' lookups (12 distinct keys, each waiting for a refresh
    # 0.2 s after its miss: seconds in all) were done with
    assert admitted_s < 0.2 * STRANGERS / 4, admitted_s
    assert received(server, 0.5) is None  # no stranger's message ever arrives
    for sock in [*strangers, ours]:
        sock.close()


def test_a_key_registered_just_before_its_handshake_gets_in(served) -> None:
    context, server, server_keys, registry = served
    stranger = client(context, server, server_keys, CurveKeys.generate())
    stranger.send(b"nobody")
    late = CurveKeys.generate()
    registry.append(Peer("node/d8", late.public))  # not looked up yet: the handshake asks
    sock = client(context, server, server_keys, late)
    sock.send(b"just registered")
    frames = received(server, 5.0)
    assert frames is not None and frames[-1].bytes == b"just registered"
    assert sender_principal(context, frames[-1]) == "node/d8"
    assert received(server, 0.5) is None
    assert authenticator_for(context).num_denied >= 1
    for s in (stranger, sock):
        s.close()
