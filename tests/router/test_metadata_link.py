"""MetadataLink against a real metadata service on 127.0.0.1 (memory backend): the mirror
answers like the service's Query after publishes, evictions, clears, restarts, lease expiry
and resyncs; Query while out of sync; load-only while the service is down; cut off when too
slow and re-synced; re-synced with a restarted service; clean close."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.events import BlockStored
from pdcluster.core.hashing import DEFAULT_HASH_CONFIG
from pdcluster.core.kv_identity import KVIdentity
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.metadata_service.publisher import NodePublisher
from pdcluster.metadata_service.server import ServerThread
from pdcluster.metadata_service.watch import BlockSubscriber
from pdcluster.router.config import RouterConfig
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.routing.dispatch import Dispatcher
from pdcluster.router.routing.metadata_link import MetadataLink
from tests.cluster_secret import (
    ROUTER_CREDENTIALS,
    SERVICE_TOKEN,
    TEST_CURVE,
    TEST_SECRET,
    node_token,
)
from tests.metadata_service.helpers import (
    make_chain,
    make_config,
    make_publisher,
)
from tests.tls_certs import make_pki

CHAINS = [make_chain(f"link{i}", 24) for i in range(4)]


async def until(predicate, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def service_hits(client: MetadataClient) -> list[dict[str, int]]:
    return [dict(client.query(chain)) for chain in CHAINS]


async def link_hits(link: MetadataLink) -> list[dict[str, int] | None]:
    return [await link.prefix_hits(chain) for chain in CHAINS]


async def mirrors(link: MetadataLink, client: MetadataClient, what: str = "") -> None:
    """Wait until the link is in sync and answers like the service; then check that those
    answers came from the mirror (no Query reached the service)."""
    async def same() -> bool:
        return link.mirror_in_sync and await link_hits(link) == service_hits(client)
    await until(same, what=what or "the mirror to match the service")
    queries = client.stats().queries
    assert await link_hits(link) == service_hits(client)
    assert client.stats().queries == queries + len(CHAINS), "the link asked the service"


def test_mirror_follows_every_kind_of_change() -> None:
    async def scenario(server: ServerThread, client: MetadataClient) -> None:
        link = MetadataLink(server.address)
        p0, n0 = make_publisher(client, "p0", ttl=30)
        p1, n1 = make_publisher(client, "p1", ttl=1)  # stops heartbeating: expires
        d0, nd = make_publisher(client, "d0", "decode", ttl=30)
        p0.publish([n0.store(CHAINS[0][:10]), n0.store(CHAINS[1][:4])])
        p1.publish([n1.store(CHAINS[0][:16])])
        await mirrors(link, client, "the first snapshot")
        assert link.mirror_blocks == client.stats().num_blocks
        d0.publish([nd.store(CHAINS[2][:8])])
        p0.publish([n0.evict(CHAINS[0][5:6]), n0.store(CHAINS[3][:3])])
        await mirrors(link, client, "stores and evictions")
        p0.seq += 1  # a lost batch: the next one resyncs p0 with a snapshot
        n0.evict(CHAINS[1][:4])
        p0.publish([n0.store(CHAINS[1][10:12])])
        d0.publish([nd.evict(list(nd.cached))])
        await mirrors(link, client, "a resync and a full eviction")
        restarted = NodePublisher(client, make_node_info("d0", "decode"), lambda: set(), 30)
        restarted.register()  # a new epoch: d0's blocks are dropped
        await until(lambda: _no_node(client, "p1"), what="p1's lease to expire")
        await mirrors(link, client, "a restart and a lease expiry")
        assert all("p1" not in hits for hits in service_hits(client))
        await link.close()
        assert link._watch_task is None

    with ServerThread(make_config()) as server, MetadataClient(server.address) as client:
        asyncio.run(scenario(server, client))


async def _no_node(client: MetadataClient, node_id: str) -> bool:
    return node_id not in [n.node_id for n in client.list_nodes()]


def test_query_while_out_of_sync_then_mirror(monkeypatch) -> None:
    gate = threading.Event()
    original = BlockSubscriber.updates

    async def gated(self):
        while not gate.is_set():
            await asyncio.sleep(0.01)
        async for update in original(self):
            yield update

    monkeypatch.setattr(BlockSubscriber, "updates", gated)

    async def scenario(server: ServerThread, client: MetadataClient) -> None:
        p0, n0 = make_publisher(client, "p0", ttl=30)
        p0.publish([n0.store(CHAINS[0][:7])])
        link = MetadataLink(server.address)
        await asyncio.sleep(0.1)
        assert not link.mirror_in_sync and link.mirror_blocks == 0
        queries = client.stats().queries
        assert await link.prefix_hits(CHAINS[0]) == {"p0": 7}
        assert client.stats().queries == queries + 1, "out of sync: answered by Query"
        gate.set()
        await mirrors(link, client)
        await link.close()

    with ServerThread(make_config()) as server, MetadataClient(server.address) as client:
        asyncio.run(scenario(server, client))


def test_without_the_mirror_every_lookup_is_a_query() -> None:
    async def scenario(server: ServerThread, client: MetadataClient) -> None:
        p0, n0 = make_publisher(client, "p0", ttl=30)
        p0.publish([n0.store(CHAINS[0][:5])])
        link = MetadataLink(server.address, mirror=False)
        await asyncio.sleep(0.2)
        queries = client.stats().queries
        assert await link.prefix_hits(CHAINS[0]) == {"p0": 5}
        assert client.stats().queries == queries + 1
        assert not link.mirror_in_sync and client.stats().block_watchers == 0
        await link.close()

    with ServerThread(make_config()) as server, MetadataClient(server.address) as client:
        asyncio.run(scenario(server, client))


def test_with_credentials_the_service_token_mirrors_and_lists_and_no_token_gets_nothing():
    """The router presents the SERVICE credential: enough to follow the index and discover
    nodes. A link without a token learns nothing (and routes on load alone)."""
    async def scenario(server: ServerThread, p0_client: MetadataClient) -> None:
        p0, n0 = make_publisher(p0_client, "p0", ttl=30)
        p0.publish([n0.store(CHAINS[0][:6])])
        link = MetadataLink(server.address, token=SERVICE_TOKEN)
        await until(lambda: _in_sync(link), what="the mirror to sync with the token")
        assert await link.prefix_hits(CHAINS[0]) == {"p0": 6}
        assert await link.list_nodes() == []  # answered (None: refused); p0 has no address
        stranger = MetadataLink(server.address, mirror=False, retry_s=60)
        assert await stranger.prefix_hits(CHAINS[0]) is None
        assert await stranger.list_nodes() is None
        assert "UNAUTHENTICATED" in stranger.last_error
        watcher = MetadataLink(server.address, backoff_s=0.05)
        await until(lambda: _watch_refused(watcher), what="the watch to be refused")
        assert not watcher.mirror_in_sync
        for each in (link, stranger, watcher):
            await each.close()

    with ServerThread(make_config(cluster_secret=TEST_SECRET)) as server, \
            MetadataClient(server.address, token=node_token("p0")) as client:
        asyncio.run(scenario(server, client))


async def _in_sync(link: MetadataLink) -> bool:
    return link.mirror_in_sync


async def _watch_refused(link: MetadataLink) -> bool:
    return "UNAUTHENTICATED" in link.watch_error


def test_load_only_while_the_service_is_down() -> None:
    async def scenario() -> None:
        link = MetadataLink(f"127.0.0.1:{free_port()}", timeout_s=0.2, retry_s=60)
        assert await link.prefix_hits(CHAINS[0]) is None
        assert not link.available and link.failures == 1 and not link.mirror_in_sync
        assert await link.prefix_hits(CHAINS[0]) is None
        assert link.failures == 1, "no retry before retry_s"
        assert await link.prefix_hits([]) == {}
        await link.close()

    asyncio.run(scenario())


def test_restarted_service_is_resynced_and_a_dead_one_answers_from_the_last_mirror() -> None:
    port = free_port()
    config = make_config(port=port)

    async def scenario() -> None:
        link = MetadataLink(f"127.0.0.1:{port}", timeout_s=0.3, retry_s=0.1)
        with ServerThread(config) as server, MetadataClient(server.address) as client:
            p0, n0 = make_publisher(client, "p0", ttl=30)
            p0.publish([n0.store(CHAINS[0][:9])])
            await mirrors(link, client, "the first service")
        await until(_out_of_sync(link), what="the stream to break")
        # the service is gone: routing goes on from the mirror it had (stale, not nothing)
        assert await link.prefix_hits(CHAINS[0]) == {"p0": 9} and not link.available
        assert link.stale_answers == 1 and link.answers_prefixes and link.mirror_blocks == 0
        with ServerThread(config) as server, MetadataClient(server.address) as client:
            p1, n1 = make_publisher(client, "p1", ttl=30)
            p1.publish([n1.store(CHAINS[0][:3]), n1.store(CHAINS[2][:5])])
            await mirrors(link, client, "the restarted service")
            assert link.mirror_syncs == 2 and link.available
            assert await link.prefix_hits(CHAINS[0]) == {"p1": 3}
        await link.close()

    asyncio.run(scenario())


def _out_of_sync(link: MetadataLink):
    async def check() -> bool:
        return not link.mirror_in_sync
    return check


def test_a_stalled_router_is_cut_off_and_resyncs() -> None:
    async def scenario(server: ServerThread, client: MetadataClient) -> None:
        link = MetadataLink(server.address, backoff_s=0.05)
        p0, n0 = make_publisher(client, "p0", ttl=30)
        p0.publish([n0.store(CHAINS[0][:6])])
        await mirrors(link, client, "the first snapshot")

        def flood() -> None:
            for i in range(150):
                p0.publish([n0.store(make_chain(f"flood{i}", 2048))])
                if client.stats().block_watchers_cut:
                    break
            p0.publish([n0.evict(CHAINS[0][3:4])])

        flooder = threading.Thread(target=flood)
        flooder.start()
        while flooder.is_alive():
            time.sleep(0.2)  # the router's loop is stuck: it reads nothing meanwhile
        assert client.stats().block_watchers_cut == 1
        await mirrors(link, client, "the resync after the cut")
        assert link.mirror_syncs == 2 and await link.prefix_hits(CHAINS[0]) == {"p0": 3}
        await link.close()

    with ServerThread(make_config(watch_max_pending_hashes=4096)) as server, \
            MetadataClient(server.address) as client:
        asyncio.run(scenario(server, client))


@pytest.mark.slow
def test_keepalive_pings_do_not_break_an_idle_stream() -> None:
    async def scenario(server: ServerThread, client: MetadataClient) -> None:
        link = MetadataLink(server.address, keepalive_s=1.5)
        await mirrors(link, client)
        await asyncio.sleep(4)
        assert link.mirror_in_sync and link.mirror_syncs == 1, link.watch_error
        await link.close()

    with ServerThread(make_config()) as server, MetadataClient(server.address) as client:
        asyncio.run(scenario(server, client))


def test_dispatcher_reaches_an_mtls_service_with_its_configs_files(tmp_path) -> None:
    """RouterConfig's metadata_tls_* fields reach the link: nodes are discovered and the index
    mirrored over mTLS (tests/security/test_metadata_tls.py attacks the real process)."""
    pki = make_pki(tmp_path)
    config = make_config(cluster_secret=TEST_SECRET, tls_cert_file=pki.server_cert,
                         tls_key_file=pki.server_key, tls_client_ca_file=pki.client_ca)
    tls = {"tls_ca_file": pki.ca, "tls_cert_file": pki.client_cert,
           "tls_key_file": pki.client_key}

    async def scenario(address: str, client: MetadataClient) -> None:
        router = RouterConfig(model_dir="unused", metadata_address=address,
                              **ROUTER_CREDENTIALS, node_timeout_s=0.2,
                              metadata_tls_ca=pki.ca, metadata_tls_cert=pki.client_cert,
                              metadata_tls_key=pki.client_key,
                              metadata_tls_server_name="localhost")
        dispatcher = Dispatcher(router, RouterMetrics(), shared_keys=TEST_CURVE)
        await dispatcher.start()
        try:
            assert set(dispatcher.nodes) == {"p0"}
            async def in_sync() -> bool:
                return dispatcher.metadata.mirror_in_sync
            await until(in_sync, what="the mirror over mTLS")
            # p0's claim is mirrored, and routed on once this router has sent it the blocks
            # (router.routing.attestations)
            assert dispatcher.metadata.mirror_node_blocks() == {"p0": 24}
            assert await dispatcher.metadata.prefix_hits(CHAINS[0]) == {}
            assert dispatcher.attestations is not None
            dispatcher.attestations.attest("p0", CHAINS[0])
            assert await dispatcher.metadata.prefix_hits(CHAINS[0]) == {"p0": 24}
        finally:
            await dispatcher.close()

    with ServerThread(config) as server, \
            MetadataClient(server.address, token=node_token("p0"), **tls) as node:
        # the KV identity of a node the router takes for the cluster's (its model folder,
        # "unused", holds no tokenizer: neither does the router's)
        identity = KVIdentity.of(16, DEFAULT_HASH_CONFIG, "unused")
        publisher = NodePublisher(node, make_node_info("p0", "prefill",
                                                       request_address="tcp://127.0.0.1:9",
                                                       identity=identity),
                                  lambda: set(CHAINS[0]), 30)
        publisher.register()
        publisher.resync()
        asyncio.run(scenario(server.address, node))


def test_a_new_incarnation_of_a_node_id_loses_what_the_old_one_was_attested() -> None:
    """p0's attested claims are routed on; p0's id then registers with another key and
    addresses, same epoch, through its proof (a holder of the proof moving it, or an impostor
    who got one). Nothing the old incarnation was sent vouches for the new one: the router
    routes no prefix to it (before: the index kept the blocks and the router its attestations,
    so the new incarnation got every follow-up)."""
    from pdcluster.core.credentials import CurveKeys
    from pdcluster.router.routing.attestations import Attestations

    config = make_config(cluster_secret=TEST_SECRET)
    with ServerThread(config) as server, MetadataClient(server.address,
                                                        token=node_token("p0")) as p0:
        old = make_node_info("p0", "prefill", request_address="tcp://127.0.0.1:7001",
                             curve_public_key=CurveKeys.generate().public, epoch=5)
        publisher = NodePublisher(p0, old, lambda: set(CHAINS[0]), 30)
        publisher.register()
        publisher.publish([BlockStored(tuple(CHAINS[0]), None, 16)])

        async def run() -> None:
            attestations = Attestations()
            link = MetadataLink(server.address, token=SERVICE_TOKEN, attestations=attestations)
            try:
                await link.list_nodes()
                attestations.attest("p0", CHAINS[0])
                await until(lambda: _hits(link, 24), what="p0's attested prefix")
                moved = make_node_info("p0", "prefill", request_address="tcp://127.0.0.1:7101",
                                       curve_public_key=CurveKeys.generate().public, epoch=5)
                reply = p0.register(moved, 30, publisher.proof)
                p0.publish("p0", 5, reply.last_seq + 1, [BlockStored(tuple(CHAINS[0]), None, 16)])
                await link.list_nodes()  # the dispatcher's refresh, before it routes again
                await until(lambda: _hits(link, 0), what="the new incarnation to hold nothing "
                            "attested")
            finally:
                await link.close()

        asyncio.run(run())


async def _hits(link: MetadataLink, expected: int) -> bool:
    hits = await link.prefix_hits(CHAINS[0])
    return hits is not None and hits.get("p0", 0) == expected
