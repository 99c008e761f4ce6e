"""The simulated nodes of `pdcluster replay` (router/sim/replay.py): a two-tier LRU prefix cache
(device, and host memory below it) that reports its changes as KV events, a FIFO server, and
the prefix-pull rule of the live nodes.

Tiers, as in the live engine (docs/engine.md): a node holds `capacity` blocks on its device and
`host_capacity` in host memory. A block the device evicts is demoted to the host (one
`BlockMoved`, or, when the host still has a copy, a `BlockRemoved` of the device copy only);
the host evicts its least recently used blocks for good. A request whose leading blocks sit
on the host loads them back to the device (they stay on the host too, so demoting them again
copies nothing). A chain is evicted tail first on both tiers.

Service-time model: a node serves one request at a time in arrival order; a request occupies
it for

    service_s = fixed_s + computed_tokens / prefill_tokens_per_s
                        + output_tokens / decode_tokens_per_s

where computed = the prompt tokens it neither holds (on any tier) nor pulls. KV from elsewhere
arrives by copy, not through the node's compute: the request is ready `pull_s + load_s`
after it arrived (a peer pull: `pull_latency_s + blocks * block_bytes / pull_bytes_per_s`; a
load from its host tier: the same with the host's figures) and starts at max(ready, the
node's previous request done), so both overlap the node's queue as the live node's
`waiting_for_remote` state does. The load a node reports: `queued_prefill_tokens` = backlog
(seconds of work not yet done) x `prefill_tokens_per_s`, `num_running` = unfinished requests,
`kv_usage` = the blocks those requests hold / device capacity (blocks that are only cached
count as free, as in the live engine's block pool).

API: `SimNode`, `apply_events` (core.block_index's), `node_pull_blocks`.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from pdcluster.core.block_index import apply_events
from pdcluster.core.events import DEVICE, HOST, BlockMoved, BlockRemoved, BlockStored, KVEvent
from pdcluster.core.types import BlockHash
from pdcluster.router.routing.policy import NodeView

TRACE_BLOCK_TOKENS = 512


__all__ = ["SimNode", "apply_events", "node_pull_blocks"]


class _EventLog:
    """Events in the order things happened, consecutive changes of one kind in one event."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self._kind: tuple | None = None
        self._hashes: list[BlockHash] = []

    def add(self, kind: tuple, block_hash: BlockHash) -> None:
        if kind != self._kind:
            self._flush()
            self._kind = kind
        self._hashes.append(block_hash)

    def _flush(self) -> None:
        if not self._hashes:
            return
        hashes, kind = tuple(self._hashes), self._kind
        self._hashes = []
        if kind == ("stored",):
            self.events.append(BlockStored(hashes, None, TRACE_BLOCK_TOKENS))
        elif kind == ("moved",):
            self.events.append(BlockMoved(hashes, DEVICE, HOST))
        else:
            assert kind is not None and kind[0] == "removed", f"unknown change {kind}"
            self.events.append(BlockRemoved(hashes, kind[1]))

    def take(self) -> list[KVEvent]:
        self._flush()
        return self.events


class SimNode:
    """A device + host LRU prefix cache and a FIFO server; reports its cache changes as KV
    events."""

    def __init__(self, node_id: str, capacity: int, host_capacity: int = 0) -> None:
        self.node_id = node_id
        self.capacity = capacity
        self.host_capacity = host_capacity
        self.cache: OrderedDict[BlockHash, None] = OrderedDict()  # the device tier
        self.host: OrderedDict[BlockHash, None] = OrderedDict()
        self.busy_until = 0.0
        self.busy_s = 0.0
        self.unfinished: deque[tuple[float, int]] = deque()  # (finish time, blocks held)
        self._held_blocks = 0

    def leading_hits(self, block_hashes: tuple[BlockHash, ...]) -> int:
        """Leading blocks held on either tier."""
        return self.leading_tiers(block_hashes)[0]

    def leading_tiers(self, block_hashes: tuple[BlockHash, ...]) -> tuple[int, int]:
        """(leading blocks held on either tier, how many of them only on the host)."""
        cache, host = self.cache, self.host
        num_host = 0
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in cache:
                if block_hash not in host:
                    return i, num_host
                num_host += 1
        return len(block_hashes), num_host

    def store(self, block_hashes: tuple[BlockHash, ...]) -> list[KVEvent]:
        """Touch (or insert, or load back from the host) a request's blocks on the device,
        block 0 ending most recently used so that a chain is evicted tail first; demote what
        the device evicts beyond capacity, drop what the host evicts."""
        log = _EventLog()
        cache = self.cache
        for block_hash in block_hashes:
            if block_hash not in cache:  # new, or loaded back from the host: a device copy
                log.add(("stored",), block_hash)
        for block_hash in reversed(block_hashes):
            cache[block_hash] = None
            cache.move_to_end(block_hash)
        while len(cache) > self.capacity:
            self._demote(cache.popitem(last=False)[0], log)
        return log.take()

    def _demote(self, block_hash: BlockHash, log: _EventLog) -> None:
        host = self.host
        if not self.host_capacity:
            log.add(("removed", DEVICE), block_hash)
            return
        if block_hash in host:
            host.move_to_end(block_hash)
            log.add(("removed", DEVICE), block_hash)
            return
        host[block_hash] = None
        log.add(("moved",), block_hash)
        while len(host) > self.host_capacity:
            log.add(("removed", HOST), host.popitem(last=False)[0])

    def touch(self, block_hashes: tuple[BlockHash, ...]) -> None:
        """Blocks a peer pulled from this node were just used: most recent on their tiers."""
        for block_hash in reversed(block_hashes):
            if block_hash in self.cache:
                self.cache.move_to_end(block_hash)
            if block_hash in self.host:
                self.host.move_to_end(block_hash)

    def view(self, now: float, cached_blocks: int, rate: float, recent_work: float) -> NodeView:
        while self.unfinished and self.unfinished[0][0] <= now:
            self._held_blocks -= self.unfinished.popleft()[1]
        backlog = max(0.0, self.busy_until - now)
        return NodeView(self.node_id, "both", cached_blocks, int(backlog * rate),
                        len(self.unfinished), min(1.0, self._held_blocks / self.capacity),
                        recent_work=recent_work)

    def serve(self, ready_s: float, service_s: float, num_blocks: int) -> float:
        """Queue a request that can start at `ready_s`; returns when it starts."""
        start = max(ready_s, self.busy_until)
        self.busy_until = start + service_s
        self.busy_s += service_s
        self.unfinished.append((self.busy_until, num_blocks))
        self._held_blocks += num_blocks
        return start


def node_pull_blocks(source_blocks: int, num_full_blocks: int, num_local_blocks: int,
                     min_pull_blocks: int) -> int:
    """Blocks a node pulls when the router names a holder of `source_blocks` leading blocks:
    the live node's rule (`transfer.connector_scheduler.ConnectorScheduler.num_pull_blocks`):
    the full blocks past its own hit, if at least `min_pull_blocks`, else none (it computes)."""
    num_blocks = min(source_blocks, num_full_blocks) - num_local_blocks
    return num_blocks if num_blocks >= min_pull_blocks else 0
