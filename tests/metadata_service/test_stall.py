"""A metadata service that stalls (SIGSTOP, a frozen VM) longer than the lease TTL must not drop
its live nodes when it resumes: the lease sweeper sees it ran late and moves every deadline
by the stall first; with etcd, whose leases expired meanwhile, the service writes its live
nodes back instead of taking etcd's deletes. Leases still expire for a node that really
stops heartbeating."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.server import ServerThread
from pdcluster.proto import metadata_pb2 as pb
from tests.metadata_service.helpers import make_config, make_publisher, wait_until
from tests.metadata_service.test_service import CHAIN, make_service, register, stored


async def _tick(clock, seconds: float, step: float = 0.1) -> None:
    """Let `seconds` of the injected clock pass in small steps, the sweeper running between
    them as it would on time."""
    for _ in range(round(seconds / step)):
        clock.now += step
        await asyncio.sleep(0.01)


def test_a_stall_past_the_ttl_keeps_every_live_node() -> None:
    async def scenario() -> None:
        service, store, clock = make_service(sweep_interval_s=0.005)
        register(service, "p0", ttl=2)
        register(service, "d0", role="decode", epoch=8, ttl=2)
        service.publish("p0", 7, 1, stored(CHAIN[:3]))
        await service.start()
        await _tick(clock, 1.0)
        clock.now += 5.0  # the process stood still for 2.5 TTLs: no heartbeat was read
        await asyncio.sleep(0.05)
        assert {n.node_id for n in service.list_nodes()} == {"p0", "d0"}
        assert service.query(b"".join(CHAIN)) == [("p0", 3)]
        assert ("down", "p0") not in store.calls
        assert service.heartbeat("p0", 7)  # the heartbeats queued during the stall count
        # d0 really stopped: it expires one TTL after its last renewal, stall excluded
        await _tick(clock, 1.5)
        assert service.heartbeat("p0", 7)
        await _tick(clock, 1.0)
        assert [n.node_id for n in service.list_nodes()] == ["p0"]
        assert ("down", "d0") in store.calls
        await service.close()

    asyncio.run(scenario())


def test_forgive_stall_moves_every_deadline() -> None:
    service, _, clock = make_service()
    register(service, "p0", ttl=2)
    clock.now += 1.5
    service.forgive_stall(10.0)
    clock.now += 10.0
    assert service.expire_leases() == []
    clock.now += 0.6
    assert service.expire_leases() == ["p0"]


def test_an_etcd_backed_service_stalled_past_the_ttl_keeps_every_live_node(etcd) -> None:
    config = make_config(backend="etcd", etcd_endpoints=(etcd.endpoint,))
    with ServerThread(config) as server, MetadataClient(server.address) as client:
        p0, node = make_publisher(client, "p0", ttl=2)
        p0.publish([node.store(CHAIN[:3])])
        wait_until(lambda: client.stats().persistence_pending_nodes == 0, what="persisted")
        downs: list[str] = []
        watch = server.call(lambda s: s.node_watch.subscribe([]))
        stop = threading.Event()

        def heartbeats() -> None:  # the live node renews every TTL/3, stall or not
            while not stop.wait(0.6):
                # the stalled service does not answer in time
                with contextlib.suppress(Exception):
                    p0.heartbeat()

        beating = threading.Thread(target=heartbeats, daemon=True)
        beating.start()
        server.call(lambda s: time.sleep(5.0), timeout_s=30)  # the loop stands still 2.5 TTLs
        time.sleep(3.0)  # etcd's lease expiry, the watch's deletes and the reconcile land
        stop.set()
        beating.join(5)
        while not watch.empty():
            change = watch.get_nowait()
            if change.kind == pb.NodeChange.DOWN:
                downs.append(change.node.node_id)
        assert downs == []
        assert client.query(CHAIN) == [("p0", 3)]
        # and etcd holds it again (under a new lease): a restarted service would find it
        wait_until(lambda: "/nodes/p0" in etcd.etcdctl("get", "--prefix", "--keys-only",
                                                        config.etcd_prefix),
                   what="the node written back to etcd")
