"""A metadata service that stalls (SIGSTOP, a frozen VM) longer than the lease TTL must not drop
its live nodes when it resumes: the lease sweeper sees it ran late and moves every deadline
by the stall first. Leases still expire for a node that really stops heartbeating."""

from __future__ import annotations

import asyncio

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
