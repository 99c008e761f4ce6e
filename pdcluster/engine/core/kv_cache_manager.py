"""Per-request block tables on top of the shared `BlockPool` (torch-free).

- `get_computed_blocks(req)`: the longest cached prefix of the request's block-hash chain,
  stopping at the first miss. At least one token is always left to compute, because the
  sampler needs the last position's logits. With a host tier (`KVTiers`) the chain goes on
  through blocks only the host holds (`HostHit`s), then only the disk holds (`DiskHit`s).
- `allocate_slots(req, num_new_tokens, computed_blocks)`: takes the prefix-hit blocks (a host
  or disk hit gets a fresh device block that its copy is loaded into before the step's model
  run) and enough fresh blocks for the new tokens, then hashes every block that these tokens
  fill (prompt or generated), so it becomes a cache hit for later requests. Returns None —
  nothing changed — when the pool cannot supply the blocks: the scheduler decides what to
  preempt.
- `free(req)`: returns the request's blocks in reverse order, so an evicted chain loses its
  tail before its head; `before_free` first waits for device writes still queued into them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdcluster.core.types import BlockHash, ReqId
from pdcluster.engine.core.block_pool import BlockPool, KVCacheBlock
from pdcluster.engine.core.kv_tiers import KVTiers, LowerHit
from pdcluster.engine.core.request import Request

PrefixHit = KVCacheBlock | LowerHit


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, enable_caching: bool = True,
                 tiers: KVTiers | None = None) -> None:
        self.pool = pool
        self.tiers = tiers
        self.block_size = pool.block_size
        self.enable_caching = enable_caching
        self.req_blocks: dict[ReqId, list[KVCacheBlock]] = {}
        self._num_hashed: dict[ReqId, int] = {}
        # Called with a request's id before any of its blocks is freed: waits for device
        # writes still queued into them (a decode step launched ahead, engine/runner/lookahead.py)
        self.before_free: Callable[[ReqId], None] | None = None

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: ReqId) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, req: Request) -> tuple[list[PrefixHit], int]:
        """Prefix hits (device blocks, and host hits with a host tier) and the number of
        tokens they hold."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = req.block_hashes[:max_blocks]
        hits: list[PrefixHit] = (self.tiers.longest_prefix(hashes) if self.tiers is not None
                                 else list(self.pool.find_longest_prefix(hashes)))
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: Sequence[PrefixHit] = (),
                       delay_caching: bool = False) -> list[KVCacheBlock] | None:
        """`delay_caching`: the new tokens' KV will arrive from elsewhere; hash the blocks
        only once it has (`cache_blocks`), so no other request hits half-written blocks."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_needed = cdiv(total_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        host_hits = [b for b in computed_blocks if not isinstance(b, KVCacheBlock)]
        # A prefix-hit block with no other user sits in the free queue: touching it uses one.
        num_reclaimed = sum(1 for b in computed_blocks
                            if isinstance(b, KVCacheBlock) and b.ref_cnt == 0)
        if max(num_needed, 0) + len(host_hits) > self.pool.num_free_blocks - num_reclaimed:
            if not blocks:
                del self.req_blocks[req.request_id]
            return None
        if computed_blocks:
            blocks.extend(self._take_hits(req, computed_blocks, host_hits))
            self._num_hashed[req.request_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        if not delay_caching:
            self.cache_blocks(req, total_tokens)
        return new_blocks

    def _take_hits(self, req: Request, computed: Sequence[PrefixHit],
                   host_hits: list[LowerHit]) -> list[KVCacheBlock]:
        """Reference the device hits; give each host or disk hit a device block its copy
        loads into, cached under its hash at once (the load runs before any model step reads
        it)."""
        device_hits = [b for b in computed if isinstance(b, KVCacheBlock)]
        self.pool.touch(device_hits)
        if not host_hits:
            return device_hits
        assert self.tiers is not None, "a lower-tier hit without tiers"
        self.tiers.pin(host_hits)
        targets = iter(self.pool.get_new_blocks(len(host_hits)))
        taken: list[KVCacheBlock] = []
        for hit in computed:
            if not isinstance(hit, KVCacheBlock):
                block = next(targets)
                self.tiers.load(hit, block)
                taken.append(block)
            else:
                taken.append(hit)
        start = len(self.req_blocks[req.request_id])
        hashes = req.block_hashes[start:start + len(taken)]
        self.pool.cache_blocks(taken, hashes, req.block_hashes[start - 1] if start else None)
        return taken

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Hash the request's blocks that the first `num_tokens` tokens fill."""
        blocks = self.req_blocks.get(req.request_id)
        if not self.enable_caching or not blocks:
            return
        hashes = req.block_hashes
        start = self._num_hashed.get(req.request_id, 0)
        end = min(num_tokens // self.block_size, len(hashes))
        if end <= start:
            return
        parent: BlockHash | None = hashes[start - 1] if start else None
        self.pool.cache_blocks(blocks[start:end], hashes[start:end], parent)
        self._num_hashed[req.request_id] = end

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the request's blocks past those `num_tokens` tokens need (blocks that held
        only rejected speculative tokens), last first. They were never hashed."""
        blocks = self.req_blocks.get(req.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks and len(blocks) > keep:
            if self.before_free is not None:
                self.before_free(req.request_id)
            extra = blocks[keep:]
            del blocks[keep:]
            assert all(b.block_hash is None for b in extra), "trimming a cached block"
            self.pool.free_blocks(reversed(extra))

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, None)
        self._num_hashed.pop(req.request_id, None)
        if blocks and self.before_free is not None:
            self.before_free(req.request_id)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
