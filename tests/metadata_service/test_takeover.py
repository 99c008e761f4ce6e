"""Attacks on node identity against two metadata-service replicas sharing a real etcd, over
gRPC with real credentials: a stolen bootstrap token (the token of node/p0, or a member's own)
tries to move, remove or shadow a live node. Each attack is paired with its control: the same
move by the holder of the registration's proof is served."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdcluster.core.credentials import CurveKeys
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.errors import MetadataAuthError
from pdcluster.metadata_service.server import ServerThread
from pdcluster.proto import metadata_pb2 as pb
from tests.cluster_secret import SERVICE_TOKEN, TEST_SECRET, node_token
from tests.metadata_service.helpers import EtcdProcess, make_config, wait_until

P0_KEY = CurveKeys.generate().public


def replica(etcd: EtcdProcess, name: str) -> ServerThread:
    return ServerThread(make_config(backend="etcd", etcd_endpoints=(etcd.endpoint,),
                                    cluster_secret=TEST_SECRET, replica_id=name))


def p0_info(**changes: object) -> pb.NodeInfo:
    fields: dict = dict(request_address="tcp://127.0.0.1:7001", kv_address="tcp://127.0.0.1:7002",
                        kv_session="127.0.0.1:7003", curve_public_key=P0_KEY, epoch=11)
    fields.update(changes)
    return make_node_info("p0", "prefill", **fields)


def attacker_info(node_id: str = "p0", **changes: object) -> pb.NodeInfo:
    fields: dict = dict(request_address="tcp://127.0.0.1:6666", kv_address="tcp://127.0.0.1:6667",
                        kv_session="127.0.0.1:6668",
                        curve_public_key=CurveKeys.generate().public, epoch=11)
    fields.update(changes)
    return make_node_info(node_id, "prefill", **fields)


@pytest.fixture
def replicas(etcd: EtcdProcess) -> Iterator[tuple[ServerThread, ServerThread]]:
    with replica(etcd, "a") as a, replica(etcd, "b") as b:
        yield a, b


def addresses(server: ServerThread, node_id: str = "p0") -> list[str]:
    with MetadataClient(server.address, token=SERVICE_TOKEN) as reader:
        return [n.request_address for n in reader.list_nodes() if n.node_id == node_id]


def register_p0(server: ServerThread) -> bytes:
    """p0 registers through `server`; returns its proof."""
    with MetadataClient(server.address, token=node_token("p0")) as p0:
        return p0.register(p0_info(), 30).registration_secret


def known_everywhere(a: ServerThread, b: ServerThread, address: str) -> None:
    wait_until(lambda: addresses(a) == [address] and addresses(b) == [address],
               what="both replicas to know p0")


def test_deregister_needs_the_registration_proof(replicas) -> None:
    a, b = replicas
    proof = register_p0(a)
    known_everywhere(a, b, "tcp://127.0.0.1:7001")
    for server in (a, b):
        with MetadataClient(server.address, token=node_token("p0")) as stolen, \
                pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
            stolen.deregister("p0")  # the token alone: refused on either replica
    assert addresses(a) == addresses(b) == ["tcp://127.0.0.1:7001"]
    with MetadataClient(b.address, token=node_token("p0")) as p0:
        p0.deregister("p0", proof)  # the holder, through the replica that did not register it
    wait_until(lambda: addresses(a) == addresses(b) == [], what="p0 to leave both")


def test_a_replica_that_did_not_register_p0_hands_out_no_proof(replicas) -> None:
    """The takeover this prevents: an identical re-registration through replica b (which never
    held p0's proof in memory) used to return a fresh proof, which then moved p0."""
    a, b = replicas
    proof = register_p0(a)
    known_everywhere(a, b, "tcp://127.0.0.1:7001")
    with MetadataClient(b.address, token=node_token("p0")) as stolen:
        minted = stolen.register(p0_info(), 30).registration_secret
        assert minted == b"", "an unchanged refresh creates no new proof"
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
            stolen.register(attacker_info(), 30, minted)
    assert addresses(a) == addresses(b) == ["tcp://127.0.0.1:7001"]
    moved = p0_info(request_address="tcp://127.0.0.1:7011")
    with MetadataClient(b.address, token=node_token("p0")) as p0:
        p0.register(moved, 30, proof)  # control: a's proof is good on b (its hash is in etcd)
    known_everywhere(a, b, "tcp://127.0.0.1:7011")


def test_a_restarted_replica_still_knows_the_proof(etcd: EtcdProcess) -> None:
    with replica(etcd, "a") as a:
        proof = register_p0(a)
        wait_until(lambda: a.call(lambda s: s.store.num_pending_nodes) == 0, what="etcd")
    with replica(etcd, "a2") as restarted, \
            MetadataClient(restarted.address, token=node_token("p0")) as client:
        assert addresses(restarted) == ["tcp://127.0.0.1:7001"]
        assert client.register(p0_info(), 30).registration_secret == b""
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
            client.register(attacker_info(), 30)
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
            client.deregister("p0")
        client.deregister("p0", proof)
        assert addresses(restarted) == []


@pytest.mark.parametrize("field", ["curve_public_key", "kv_address", "kv_session",
                                   "request_address"])
def test_a_member_cannot_register_a_live_nodes_key_or_addresses(replicas, field) -> None:
    """Member p9 registers its own id with one of p0's identifying values: it would pass the
    side channel's checks as p0 (a shared key or KV address) or break p0's transfers."""
    a, b = replicas
    register_p0(a)
    known_everywhere(a, b, "tcp://127.0.0.1:7001")
    value = P0_KEY if field == "curve_public_key" else getattr(p0_info(), field)
    copied = attacker_info("p9", **{field: value})
    with MetadataClient(b.address, token=node_token("p9")) as p9:
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED.*already"):
            p9.register(copied, 30)
        assert p9.register(attacker_info("p9"), 30).registration_secret  # control: its own
    assert addresses(b, "p9") == ["tcp://127.0.0.1:6666"]


def test_router_keys_live_in_etcd_for_every_replica(replicas) -> None:
    a, b = replicas
    router_key = CurveKeys.generate().public
    with MetadataClient(a.address, token=SERVICE_TOKEN) as router:
        router.register_client("r1", router_key, 30)
    with MetadataClient(b.address, token=SERVICE_TOKEN) as reader:
        wait_until(lambda: [c.client_id for c in reader.list_clients()] == ["r1"],
                   what="replica b to know the router's key")
    register_p0(a)
    with MetadataClient(a.address, token=SERVICE_TOKEN) as router, \
            pytest.raises(MetadataAuthError, match="PERMISSION_DENIED.*already"):
        router.register_client("r2", P0_KEY, 30)  # a live node's key is not a router's


def test_router_keys_expire_on_every_replica(replicas) -> None:
    a, b = replicas
    with MetadataClient(a.address, token=SERVICE_TOKEN) as router:
        router.register_client("r1", CurveKeys.generate().public, 2)
    with MetadataClient(b.address, token=SERVICE_TOKEN) as reader:
        wait_until(lambda: len(reader.list_clients()) == 1, what="b to know r1")
        wait_until(lambda: reader.list_clients() == [], timeout_s=15,
                   what="r1's lease to end on b")


@pytest.mark.parametrize("field, value", [("block_size", 32), ("model", "other-model"),
                                          ("hash_algorithm", "xxh3_128"),
                                          ("capacity_blocks", 1)])
def test_a_stolen_token_cannot_change_what_a_live_node_declares(replicas, field, value) -> None:
    """Same key, addresses and epoch, another KV identity or capacity: the router would hash
    p0's blocks (or cap them) otherwise and stop routing to it. Needs the proof too."""
    a, b = replicas
    proof = register_p0(a)
    known_everywhere(a, b, "tcp://127.0.0.1:7001")
    changed = p0_info()
    setattr(changed, field, value)
    with MetadataClient(b.address, token=node_token("p0")) as stolen, \
            pytest.raises(MetadataAuthError, match="PERMISSION_DENIED"):
        stolen.register(changed, 30)
    with MetadataClient(b.address, token=node_token("p0")) as p0:
        assert p0.register(changed, 30, proof).registration_secret  # control: the holder
