"""The faults of the chaos benchmark: real actions on the real processes of a `ChaosCluster`,
each an async function run beside the load (`chaos_load.run_load`'s `on_start`).

A fault waits until `FaultRun.at_s` on the load's clock, acts, and records on its `FaultRun`
when it began and ended (`start`, `end`: seconds on that clock) and what else it measured
(`extra`). Blocking calls (Ray, signals, waiting for a port) run in threads so the load's
event loop keeps sending.

- `prefill_kill`: a prefill node with requests in flight hangs, then dies. The node and its
  child processes are frozen (SIGSTOP) until the router sends it one more request (at most
  2 s): that request's KV surely cannot leave, and its decode node is waiting for it. Then the
  node is SIGKILLed; Ray restarts it under the same id. A request the router counted in
  flight when the freeze began is not enough: the node may have sent its KV and not yet its
  reply. The children freeze too because a vLLM node's engine runs in them: with the node
  process alone stopped, vLLM's engine core and worker moved the KV during the freeze.
  `sent_while_frozen` says whether the kill caught such a request.

Every node kill (`prefill_kill`, `decode_kill`, `node_restart`) also checks that the node's
child processes (a vLLM node's engine core and worker) exit with it
(benchmarks/chaos_procs.py: `children_gone_after_s`, and `orphans_killed` by the benchmark
when they did not).
- `decode_kill`: the decode node with the most open streams is SIGKILLed.
- `metadata_stall`: the metadata service SIGSTOPped for twice the lease TTL, then SIGCONTed;
  the router's index is watched through the stall and one TTL after it: no node holding
  blocks may lose them all (`nodes_erased_from_router_index`), and routing stays prefix-aware.
- `metadata_restart`: the metadata service SIGKILLed and started again on the same port.
- `etcd_restart`: etcd SIGKILLed, started again on the same data after 2 s (etcd backend).
- `slow_link`: 1% of the packets between nodes dropped, and 50 ms of delay where the kernel
  has netem, for `LINK_FAULT_S`; `partition`: all of them, healed after `LINK_FAULT_S`
  (benchmarks/chaos_netns.py: in the benchmark's own network namespace only).
- `node_restart`: a prefill node holding cached blocks SIGKILLed; Ray restarts it under the
  same id with an empty cache: when its old blocks left the router's index, and whether its
  re-registration (a new epoch) removed them or its lease had already expired.

API: `FaultRun`, `FAULTS` (name -> fault function), `LINK_FAULTS`, `fault_seconds`.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from benchmarks.chaos_cluster import ChaosCluster
from benchmarks.chaos_procs import descendants, reap

LINK_FAULT_S = 10.0  # how long a slow link or a partition lasts before it heals


@dataclass(slots=True)
class FaultRun:
    cluster: ChaosCluster
    at_s: float
    start: float = math.nan
    end: float = math.nan
    extra: dict = field(default_factory=dict)


async def _until(t0: float, at_s: float) -> None:
    await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))


async def router_health(cluster: ChaosCluster) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session, \
            session.get(f"{cluster.router_url}/health") as reply:
        return await reply.json()


async def _busiest(cluster: ChaosCluster, role: str, timeout_s: float = 5.0) -> str:
    """The node of `role` with the most requests in flight per the router (waits for one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = (await router_health(cluster))["nodes"]
        ranked = sorted((info["inflight"], node_id) for node_id, info in nodes.items()
                        if info["role"] == role and info["healthy"])
        if ranked and (ranked[-1][0] > 0 or time.monotonic() > deadline):
            return ranked[-1][1]
        await asyncio.sleep(0.02)


async def prefill_kill(run: FaultRun, t0: float) -> None:
    pids = await asyncio.to_thread(run.cluster.node_pids)
    await _until(t0, run.at_s)
    victim = await _busiest(run.cluster, "prefill")
    children = descendants(pids[victim])
    for pid in [pids[victim], *children]:  # holds its requests' KV until the kill
        os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    inflight = fewest = (await router_health(run.cluster))["nodes"][victim]["inflight"]
    # Streams only end now if the router gives them up (their decode node finished): one
    # more than the fewest seen is a request sent after the freeze.
    while time.monotonic() - frozen < 2.0 and inflight <= fewest:
        await asyncio.sleep(0.05)
        inflight = (await router_health(run.cluster))["nodes"][victim]["inflight"]
        fewest = min(fewest, inflight)
    os.kill(pids[victim], signal.SIGKILL)  # its children die with it (a stopped one too)
    run.start = run.end = time.monotonic() - t0
    run.extra.update(victim=victim, inflight_at_kill=inflight,
                     sent_while_frozen=inflight > fewest,
                     frozen_before_kill_s=round(time.monotonic() - frozen, 3))
    run.extra.update((await asyncio.to_thread(reap, children)).as_dict())


async def decode_kill(run: FaultRun, t0: float) -> None:
    pids = await asyncio.to_thread(run.cluster.node_pids)
    await _until(t0, run.at_s)
    victim = await _busiest(run.cluster, "decode")
    inflight = (await router_health(run.cluster))["nodes"][victim]["inflight"]
    children = descendants(pids[victim])
    os.kill(pids[victim], signal.SIGKILL)
    run.start = run.end = time.monotonic() - t0
    run.extra.update(victim=victim, inflight_at_kill=inflight)
    run.extra.update((await asyncio.to_thread(reap, children)).as_dict())


async def metadata_stall(run: FaultRun, t0: float) -> None:
    proc = run.cluster.metadata
    assert proc is not None, "no metadata service to stall"
    await _until(t0, run.at_s)
    ttl = run.cluster.settings.lease_ttl_s
    health = await router_health(run.cluster)
    held = {n for n, c in health["metadata"]["mirror_node_blocks"].items() if c}
    proc.send_signal(signal.SIGSTOP)
    run.start = time.monotonic() - t0
    routing, erased = [], set()
    while time.monotonic() - t0 - run.start < 3 * ttl:  # the stall, then one TTL after it
        if math.isnan(run.end) and time.monotonic() - t0 - run.start >= 2 * ttl:
            proc.send_signal(signal.SIGCONT)
            run.end = time.monotonic() - t0
        health = await router_health(run.cluster)
        if math.isnan(run.end):
            routing.append(health["routing"])
        counts = health["metadata"]["mirror_node_blocks"]
        erased |= {n for n in held if counts and not counts.get(n, 0)}
        await asyncio.sleep(0.25)
    run.extra.update(stall_s=2 * ttl, nodes_erased_from_router_index=sorted(erased),
                     prefix_aware_share_during=round(
                         routing.count("prefix_aware") / max(1, len(routing)), 3))


async def metadata_restart(run: FaultRun, t0: float) -> None:
    await _until(t0, run.at_s)
    run.cluster.kill_metadata()
    run.start = time.monotonic() - t0
    await asyncio.to_thread(run.cluster.start_metadata)
    run.end = time.monotonic() - t0


async def etcd_restart(run: FaultRun, t0: float) -> None:
    if run.cluster.etcd is None:
        raise RuntimeError("the etcd fault needs the etcd backend (--backend etcd)")
    await _until(t0, run.at_s)
    run.cluster.kill_etcd()
    run.start = time.monotonic() - t0
    await asyncio.sleep(2.0)
    await asyncio.to_thread(run.cluster.start_etcd)
    run.end = time.monotonic() - t0


async def node_restart(run: FaultRun, t0: float) -> None:
    pids = await asyncio.to_thread(run.cluster.node_pids)
    await _until(t0, run.at_s)
    counts = (await router_health(run.cluster))["metadata"]["mirror_node_blocks"]
    victim = max((n for n in pids if n.startswith("p")), key=lambda n: counts.get(n, 0))
    epoch = await _epoch(run.cluster, victim)
    children = descendants(pids[victim])
    os.kill(pids[victim], signal.SIGKILL)
    run.start = time.monotonic() - t0
    reaped = asyncio.ensure_future(asyncio.to_thread(reap, children))
    gone = reregistered = math.nan
    restart_s = run.cluster.settings.node_start_s
    while time.monotonic() - t0 - run.start < restart_s and math.isnan(reregistered):
        now = time.monotonic() - t0
        health = await router_health(run.cluster)
        if math.isnan(gone) and not health["metadata"]["mirror_node_blocks"].get(victim, 0):
            gone = now
        if await _epoch(run.cluster, victim) not in (None, epoch):  # the new incarnation
            reregistered = now
        await asyncio.sleep(0.02)
    run.end = reregistered
    run.extra.update((await reaped).as_dict())
    run.extra.update(
        victim=victim, blocks_before_kill=counts.get(victim, 0),
        old_blocks_gone_after_s=round(gone - run.start, 3),
        reregistered_after_s=round(reregistered - run.start, 3),
        # re-registration under a new epoch clears them at once; a restart slower than the
        # lease TTL finds them already gone with the lease
        old_blocks_cleared_by="re-registration" if gone >= reregistered - 0.1
        else "lease expiry")


async def _link_fault(run: FaultRun, t0: float, loss: float, delay_ms: int) -> None:
    from benchmarks.chaos_netns import LinkFault, kv_ports

    cluster = run.cluster
    assert cluster.ray is not None, "the cluster is not up"
    nodes = await asyncio.to_thread(cluster.ray.nodes)
    fault = LinkFault(kv_ports(nodes, await asyncio.to_thread(cluster.node_pids)))
    await _until(t0, run.at_s)
    try:
        fault.drop(loss)
        delayed = fault.delay(delay_ms) if delay_ms else False
        run.start = time.monotonic() - t0
        healthy = []
        while time.monotonic() - t0 - run.start < LINK_FAULT_S:
            nodes_now = (await router_health(cluster))["nodes"]
            healthy.append(all(n["healthy"] for n in nodes_now.values()))
            await asyncio.sleep(0.25)
        dropped = fault.packets_dropped()
    finally:
        fault.clear()
    run.end = time.monotonic() - t0
    run.extra.update(link_ports=len(fault.ports), loss=loss, link_fault_s=LINK_FAULT_S,
                     delay_ms=delay_ms if delayed else 0, packets_dropped=dropped,
                     all_nodes_healthy_share=round(sum(healthy) / max(1, len(healthy)), 3))
    if delay_ms and not delayed:
        run.extra["delay_missing"] = "tc netem is not in this kernel: loss only"


async def slow_link(run: FaultRun, t0: float) -> None:
    await _link_fault(run, t0, loss=0.01, delay_ms=50)


async def partition(run: FaultRun, t0: float) -> None:
    await _link_fault(run, t0, loss=1.0, delay_ms=0)


async def _epoch(cluster: ChaosCluster, node_id: str) -> int | None:
    from pdcluster.core.credentials import SERVICE
    from pdcluster.metadata_service.client import AsyncMetadataClient

    client = AsyncMetadataClient(cluster.metadata_address,
                                 token=cluster.secret.metadata_token(SERVICE), timeout_s=2.0)
    try:
        nodes = await client.list_nodes()
    except Exception:  # the service is down: not known now
        return None
    finally:
        await client.close()
    return next((n.epoch for n in nodes if n.node_id == node_id), None)


def fault_seconds(name: str, lease_ttl_s: int) -> float:
    """How long fault `name` lasts, about: the load runs on that long after it begins."""
    return {"metadata_stall": 3 * lease_ttl_s, "metadata_restart": 2.0, "etcd_restart": 3.0,
            "node_restart": 15.0, "prefill_kill": 1.0, "slow_link": LINK_FAULT_S,
            "partition": 2 * LINK_FAULT_S}.get(name, 0.0)


FaultFn = Callable[[FaultRun, float], Awaitable[None]]
FAULTS: dict[str, FaultFn] = {
    "prefill_kill": prefill_kill, "decode_kill": decode_kill,
    "metadata_stall": metadata_stall, "metadata_restart": metadata_restart,
    "etcd_restart": etcd_restart, "node_restart": node_restart,
    "slow_link": slow_link, "partition": partition,
}
LINK_FAULTS = ("slow_link", "partition")  # they run in the benchmark's own network namespace
