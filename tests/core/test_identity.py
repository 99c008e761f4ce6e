"""The key directory (core.identity): who a CURVE key is, as the authority says, found on a
miss without flooding the authority, and not forgotten the moment the authority blinks."""

from __future__ import annotations

import time

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.identity import Directory, Peer, is_router, node_id_of


class Authority:
    def __init__(self) -> None:
        self.peers: list[Peer] = []
        self.calls = 0

    def __call__(self) -> list[Peer]:
        self.calls += 1
        return list(self.peers)


def test_a_key_registered_before_its_handshake_is_found_at_once():
    authority = Authority()
    directory = Directory(refresh=authority, min_refresh_s=0.05)
    directory.refresh_now(force=True)
    router = CurveKeys.generate().public
    authority.peers.append(Peer("router/r1", router))  # registered after the last refresh
    assert directory.principal_of(router) == "router/r1"
    node = Peer("node/d0", CurveKeys.generate().public, "tcp://a:1", "tcp://a:2", "a:3")
    authority.peers.append(node)
    assert directory.by_kv_address("tcp://a:2") == node
    assert directory.server_key_for("tcp://a:2") == node.public_key
    assert directory.peer("node/d0") == node


def test_a_flood_of_unknown_keys_costs_one_lookup_per_interval():
    authority = Authority()
    directory = Directory(refresh=authority, min_refresh_s=0.05)
    start = time.monotonic()
    for _ in range(10):
        assert directory.principal_of(CurveKeys.generate().public) is None
    elapsed = time.monotonic() - start
    assert authority.calls <= elapsed / 0.05 + 2  # strangers wait; the authority does not


def test_a_key_that_leaves_the_registry_stays_known_for_the_grace():
    now = [100.0]
    authority = Authority()
    key = CurveKeys.generate().public
    authority.peers.append(Peer("router/r1", key))
    directory = Directory(refresh=authority, clock=lambda: now[0], grace_s=15.0)
    directory.refresh_now(force=True)
    authority.peers.clear()  # e.g. a metadata service restarted empty
    now[0] += 10
    directory.refresh_now(force=True)
    assert directory.peer("router/r1") is not None
    now[0] += 6
    directory.refresh_now(force=True)
    assert directory.peer("router/r1") is None  # revoked, once the grace is over


def test_granted_peers_outlive_every_refresh_and_listeners_see_changes():
    authority = Authority()
    directory = Directory(refresh=authority)
    own = Peer("node/p0", CurveKeys.generate().public, "tcp://p:1", "tcp://p:2", "p:3")
    directory.grant(own)
    seen: list[list[Peer]] = []
    directory.subscribe(seen.append)
    directory.refresh_now(force=True)
    assert directory.principal_of(own.public_key) == "node/p0"
    assert seen and all(own in peers for peers in seen)


def test_principal_helpers():
    assert is_router("router/x") and not is_router("node/x") and not is_router(None)
    assert node_id_of("node/d0") == "d0" and node_id_of("router/x") is None
