"""What one member may add to the metadata service, attacked over gRPC with real credentials:
a node cannot grow the index (and so etcd and every router's mirror) past its cap — its
declared capacity times `node_capacity_factor`, at most `max_node_blocks` — and, with an
allowlist, no token can register a node id the operator did not plan."""

from __future__ import annotations

import pytest

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.events import BlockStored
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.errors import MetadataAuthError, MetadataRequestError
from pdcluster.metadata_service.server import ServerThread
from tests.cluster_secret import TEST_SECRET, node_token
from tests.metadata_service.helpers import make_chain, make_config

CHAIN = make_chain("bounds", 2000)


def _member(server: ServerThread, node_id: str, capacity_blocks: int) -> MetadataClient:
    client = MetadataClient(server.address, token=node_token(node_id))
    client.register(make_node_info(node_id, "decode", capacity_blocks=capacity_blocks, epoch=3,
                                   curve_public_key=CurveKeys.generate().public), 30)
    return client


def _stored(hashes: list[bytes]) -> list[BlockStored]:
    return [BlockStored(tuple(hashes[i:i + 500]), None, 16) for i in range(0, len(hashes), 500)]


def test_a_member_cannot_claim_more_than_its_declared_capacity_allows() -> None:
    config = make_config(cluster_secret=TEST_SECRET, node_capacity_factor=4,
                         max_node_blocks=1500)
    with ServerThread(config) as server:
        small = _member(server, "d1", capacity_blocks=100)  # cap 400
        assert small.publish("d1", 3, 1, _stored(CHAIN[:400])).status == 0  # control: at cap
        with pytest.raises(MetadataRequestError, match="over_capacity"):
            small.publish("d1", 3, 2, _stored(CHAIN[400:401]))
        with pytest.raises(MetadataRequestError, match="over_capacity"):
            small.snapshot("d1", 3, 3, CHAIN[:401])
        big = _member(server, "d2", capacity_blocks=10**12)  # declares more: max_node_blocks
        with pytest.raises(MetadataRequestError, match="over_capacity"):
            big.publish("d2", 3, 1, _stored(CHAIN[:1501]))
        assert big.publish("d2", 3, 2, _stored(CHAIN[:1500])).status != 0  # the gap resyncs
        big.snapshot("d2", 3, 2, CHAIN[:1500])  # control: at the hard cap
        stats = small.stats()
        assert stats.num_entries == 400 + 1500
        assert stats.rejected_by_reason["over_capacity"] == 3
        small.close()
        big.close()


def test_only_allowed_node_ids_register() -> None:
    config = make_config(cluster_secret=TEST_SECRET,
                         node_allowlist={"prefill": frozenset({"p0"}),
                                         "decode": frozenset({"d0"})})
    with ServerThread(config) as server:
        for node_id, role in (("p7", "prefill"), ("d0", "prefill"), ("p0", "decode")):
            with MetadataClient(server.address, token=node_token(node_id)) as minted, \
                    pytest.raises(MetadataAuthError, match="PERMISSION_DENIED.*allowlist"):
                minted.register(make_node_info(node_id, role,
                                               curve_public_key=CurveKeys.generate().public), 30)
        for node_id, role in (("p0", "prefill"), ("d0", "decode")):  # control: the planned ids
            with MetadataClient(server.address, token=node_token(node_id)) as planned:
                assert planned.register(make_node_info(
                    node_id, role, curve_public_key=CurveKeys.generate().public),
                    30).registration_secret


def test_at_most_max_nodes_live_nodes_per_role() -> None:
    """With a planner the ids are new on every start: the count bounds what any token adds."""
    config = make_config(cluster_secret=TEST_SECRET, max_nodes={"decode": 2})
    with ServerThread(config) as server:
        clients = {}
        for node_id in ("d1", "d2", "d3"):
            clients[node_id] = MetadataClient(server.address, token=node_token(node_id))
        infos = {n: make_node_info(n, "decode", curve_public_key=CurveKeys.generate().public)
                 for n in clients}
        proofs = {n: clients[n].register(infos[n], 30).registration_secret for n in ("d1", "d2")}
        with pytest.raises(MetadataAuthError, match="PERMISSION_DENIED.*2 live nodes"):
            clients["d3"].register(infos["d3"], 30)
        assert clients["d1"].register(infos["d1"], 30).lease_ttl_s  # a refresh is no new node
        clients["d2"].deregister("d2", proofs["d2"])  # control: a place frees, d3 takes it
        assert clients["d3"].register(infos["d3"], 30).registration_secret
        with MetadataClient(server.address, token=node_token("p1")) as p1:  # no prefill limit
            assert p1.register(make_node_info("p1", "prefill"), 30).registration_secret
        for client in clients.values():
            client.close()
