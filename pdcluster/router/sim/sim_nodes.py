"""The simulated nodes of `pdcluster replay` (router/sim/replay.py): an LRU prefix cache that
reports its changes as KV events, a FIFO server, and the prefix-pull rule of the live nodes.

Service-time model: a node serves one request at a time in arrival order; a request occupies
it for

    service_s = fixed_s + computed_tokens / prefill_tokens_per_s
                        + output_tokens / decode_tokens_per_s

where computed = the prompt tokens it neither holds nor pulls. A pulled prefix arrives over
the network, not through the node's compute: the request is ready `pull_s` after it arrived
(`pull_latency_s + pulled_blocks * block_bytes / pull_bytes_per_s`) and starts at
max(ready, the node's previous request done), so a pull overlaps the node's queue as the live
node's `waiting_for_remote` state does. The load a node reports: `queued_prefill_tokens` =
backlog (seconds of work not yet done) x `prefill_tokens_per_s`, `num_running` = unfinished
requests, `kv_usage` = the blocks those requests hold / capacity (blocks that are only cached
count as free, as in the live engine's block pool).

API: `SimNode`, `apply_events`, `node_pull_blocks`.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from pdcluster.core.block_index import BlockIndex
from pdcluster.core.events import BlockRemoved, BlockStored, KVEvent
from pdcluster.core.types import BlockHash
from pdcluster.router.routing.policy import NodeView

TRACE_BLOCK_TOKENS = 512


class SimNode:
    """An LRU prefix cache and a FIFO server; reports its cache changes as KV events."""

    def __init__(self, node_id: str, capacity: int) -> None:
        self.node_id = node_id
        self.capacity = capacity
        self.cache: OrderedDict[BlockHash, None] = OrderedDict()
        self.busy_until = 0.0
        self.busy_s = 0.0
        self.unfinished: deque[tuple[float, int]] = deque()  # (finish time, blocks held)
        self._held_blocks = 0

    def leading_hits(self, block_hashes: tuple[BlockHash, ...]) -> int:
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in self.cache:
                return i
        return len(block_hashes)

    def store(self, block_hashes: tuple[BlockHash, ...]) -> list[KVEvent]:
        """Touch (or insert) a request's blocks, block 0 ending most recently used so that a
        chain is evicted tail first; evict beyond capacity."""
        new = [h for h in block_hashes if h not in self.cache]
        for block_hash in reversed(block_hashes):
            self.cache[block_hash] = None
            self.cache.move_to_end(block_hash)
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        events: list[KVEvent] = []
        if new:
            events.append(BlockStored(tuple(new), None, TRACE_BLOCK_TOKENS))
        if evicted:
            events.append(BlockRemoved(tuple(evicted)))
        return events

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


def apply_events(index: BlockIndex, node_id: str, events: list[KVEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            index.add_blocks(node_id, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.remove_blocks(node_id, event.block_hashes)
        else:
            index.clear_node(node_id)


def node_pull_blocks(source_blocks: int, num_full_blocks: int, num_local_blocks: int,
                     min_pull_blocks: int) -> int:
    """Blocks a node pulls when the router names a holder of `source_blocks` leading blocks:
    the live node's rule (`transfer.connector_scheduler.ConnectorScheduler.num_pull_blocks`):
    the full blocks past its own hit, if at least `min_pull_blocks`, else none (it computes)."""
    num_blocks = min(source_blocks, num_full_blocks) - num_local_blocks
    return num_blocks if num_blocks >= min_pull_blocks else 0
