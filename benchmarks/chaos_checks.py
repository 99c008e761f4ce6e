"""What the chaos benchmark checks after each fault, on the live cluster
(benchmarks/chaos_cluster.py):

- `drain_and_count_leaks`: wait until every node is idle (no request, nothing pinned for a
  transfer), then count on each node the KV blocks still referenced and the blocks missing
  from its free list: both must be 0 (a leak otherwise);
- `IndexCheck`: whether the global index is exact: for every node, the blocks the metadata
  service's index names (followed here through its watch stream, as the router does) equal
  the blocks in the node's prefix cache, the router's mirror holds as many blocks for it, and
  neither names a node that holds nothing; `until_exact` polls until it is, or a deadline;
- `rss_bytes`: resident memory of the given processes.

API: `drain_and_count_leaks`, `IndexCheck`, `rss_bytes`.
"""

from __future__ import annotations

import asyncio
import time

from benchmarks.chaos_cluster import ChaosCluster


def _ray_get(refs, timeout_s: float):
    import ray

    return ray.get(refs, timeout=timeout_s)


def drain_and_count_leaks(cluster: ChaosCluster, timeout_s: float | None = None) -> dict:
    """{node: {"held_blocks", "missing_free_blocks", "idle_after_s"}}; `idle_after_s` None
    if the node never became idle (within `timeout_s`, by default as long as a node may take
    to restart). Every node is asked at once, every 50 ms, so one that restarts (and answers
    late) does not delay the others' figures."""
    import ray

    timeout_s = timeout_s or cluster.settings.node_start_s
    started = time.monotonic()
    results: dict[str, dict] = {}
    asked: dict = {}  # node id -> the pool_state call in flight
    while len(results) < len(cluster.actors) and time.monotonic() - started < timeout_s:
        for node_id, actor in cluster.actors.items():
            if node_id not in results and node_id not in asked:
                asked[node_id] = actor.pool_state.remote()
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=0.05)
        now = time.monotonic()
        for node_id, ref in [(n, r) for n, r in asked.items() if r in ready]:
            del asked[node_id]
            try:
                state = ray.get(ref)
            except Exception:  # the actor died or is restarting: ask again
                continue
            if not state["num_unfinished"] and not state["num_pinned_requests"]:
                results[node_id] = {
                    "held_blocks": state["num_held_blocks"],
                    "missing_free_blocks": state["num_blocks"] - state["num_free_blocks"],
                    "idle_after_s": round(now - started, 3)}
        time.sleep(0.05)
    for node_id in cluster.actors:
        results.setdefault(node_id, {"held_blocks": None, "missing_free_blocks": None,
                                     "idle_after_s": None})
    return results


def total_leaked(leaks: dict) -> int | None:
    """Blocks leaked over every node; None when some node never became idle."""
    total = 0
    for figures in leaks.values():
        if figures["held_blocks"] is None:
            return None
        total += figures["held_blocks"] + figures["missing_free_blocks"]
    return total


class IndexCheck:
    """Follows the metadata service's index (the router's own `MetadataLink`) to compare it
    with the nodes' caches and the router's mirror. Create and use it on one event loop."""

    def __init__(self, cluster: ChaosCluster) -> None:
        from pdcluster.core.credentials import SERVICE
        from pdcluster.router.routing.metadata_link import MetadataLink

        self.cluster = cluster
        self.link = MetadataLink(cluster.metadata_address,
                                 token=cluster.secret.metadata_token(SERVICE),
                                 backoff_s=0.05, max_backoff_s=0.5)

    async def close(self) -> None:
        await self.link.close()

    async def differences(self, session) -> list[str]:
        """What keeps the index from being exact now ([] when it is)."""
        actors = self.cluster.actors
        try:
            cached = await asyncio.to_thread(
                _ray_get, [a.cached_block_hashes.remote() for a in actors.values()], 10)
        except Exception as exc:  # a node restarting: not exact yet
            return [f"nodes unreachable: {type(exc).__name__}"]
        async with session.get(f"{self.cluster.router_url}/health") as reply:
            router_counts = (await reply.json())["metadata"]["mirror_node_blocks"]
        problems = []
        for node_id, hashes in zip(actors, cached, strict=True):
            indexed = self.link.mirror_node_hashes(node_id)
            if indexed is None:
                return ["the metadata service's index is not followed yet"]
            if indexed != set(hashes):
                problems.append(f"{node_id}: index {len(indexed)} blocks, cache {len(hashes)}"
                                f" ({len(indexed - set(hashes))} stale)")
            if router_counts.get(node_id, 0) != len(hashes):
                problems.append(f"{node_id}: router mirror {router_counts.get(node_id, 0)}, "
                                f"cache {len(hashes)}")
        for node_id, count in router_counts.items():
            if node_id not in actors and count:
                problems.append(f"router mirror names unknown node {node_id}")
        return problems

    async def until_exact(self, timeout_s: float) -> tuple[float | None, list[str]]:
        """(seconds until the index was exact, or None; the last differences seen)."""
        import aiohttp

        started = time.monotonic()
        async with aiohttp.ClientSession() as session:
            while True:
                problems = await self.differences(session)
                elapsed = time.monotonic() - started
                if not problems:
                    return round(elapsed, 3), []
                if elapsed > timeout_s:
                    return None, problems
                await asyncio.sleep(0.1)


def rss_bytes(pids: dict[str, int]) -> dict[str, int]:
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            out[name] = 0
    return out
