"""Upper bounds on prefix reuse for `pdcluster replay`: what no placement can beat.

- `ideal_hit_ratio`: one infinite prefix cache; a block hits when its whole prefix was seen
  before. The bound with unlimited memory, local or pulled.
- `achievable_hit_ratio`: one LRU prefix cache as large as all the nodes' tiers together
  (a chain evicted tail first, as on the nodes). The bound for the cluster's finite memory,
  as if it were one pool with no network between its parts: what a replay with small caches
  reads its reuse against ("x achievable"), where "x ideal" mixes up the router's losses
  with the memory's.
- `ideal_ttfts`: every request's TTFT with no queue and the infinite cache's reuse, free of
  any copy cost: its fresh tokens' prefill alone. No placement's TTFT percentiles go below
  these; where a goal asks for less, the trace's fresh prompt tokens stand in the way.

API: `ideal_hit_ratio`, `achievable_hit_ratio`, `ideal_ttfts`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Protocol

from pdcluster.core.types import BlockHash


class _Request(Protocol):
    @property
    def block_hashes(self) -> tuple[BlockHash, ...]: ...

    @property
    def input_length(self) -> int: ...


def _leading_run(block_hashes: Sequence[BlockHash], cached: Container[BlockHash]) -> int:
    """How many of a request's blocks, from the first, are in `cached` (a prefix hit)."""
    count = 0
    for block_hash in block_hashes:
        if block_hash not in cached:
            break
        count += 1
    return count


def ideal_hit_ratio(requests: Sequence[_Request]) -> float:
    """The hit ratio of one infinite cache: a block hits when its whole prefix was seen."""
    seen: set[BlockHash] = set()
    hit_blocks = total_blocks = 0
    for req in requests:
        hit_blocks += _leading_run(req.block_hashes, seen)
        total_blocks += len(req.block_hashes)
        seen.update(req.block_hashes)
    return round(hit_blocks / max(total_blocks, 1), 4)


def achievable_hit_ratio(requests: Sequence[_Request], capacity: int) -> float:
    """The hit ratio of one LRU prefix cache of `capacity` blocks."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    cache: OrderedDict[BlockHash, None] = OrderedDict()
    hit_blocks = total_blocks = 0
    for req in requests:
        hit_blocks += _leading_run(req.block_hashes, cache)
        total_blocks += len(req.block_hashes)
        for block_hash in reversed(req.block_hashes):
            cache[block_hash] = None
            cache.move_to_end(block_hash)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return round(hit_blocks / max(total_blocks, 1), 4)


def ideal_ttfts(requests: Sequence[_Request], fixed_s: float, prefill_tokens_per_s: float,
                block_tokens: int) -> list[float]:
    """Each request's TTFT with no queue and every leading block seen before reused for free,
    sorted."""
    seen: set[BlockHash] = set()
    ttfts = []
    for req in requests:
        hits = 0
        for block_hash in req.block_hashes:
            if block_hash not in seen:
                break
            hits += 1
        seen.update(req.block_hashes)
        fresh = max(0, req.input_length - hits * block_tokens)
        ttfts.append(fixed_s + fresh / prefill_tokens_per_s)
    return sorted(ttfts)
