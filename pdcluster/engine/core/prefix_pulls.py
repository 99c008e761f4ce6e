"""Global prefix reuse, the engine's half (torch-free): pulling a prompt's cached prefix from
another node instead of computing it, and serving such pulls to other nodes.

Requester (a request with a `PrefixPull` hint, admitted from the waiting queue):
1. Its local prefix hit is k0 blocks; the hint names a holder with k blocks. The connector
   decides how many to pull (`num_pull_blocks`: its threshold; never the block holding the
   last prompt token). If any, the scheduler allocates blocks [k0, k) unhashed and parks the
   request in `WAITING_FOR_REMOTE_KVS`; `on_parked` hands the connector their ids and what
   names them (`PrefixTokens`: the prompt's leading tokens and its cache salt). The parked
   blocks count against the node's pin budget (engine/core/pins.py); a pull that does not fit is
   not made, and the request computes its prefix.
2. `apply_result`: n <= k - k0 blocks arrived (the holder sends the leading run it still
   has; 0 on failure or timeout). They are hashed into the prefix cache, the request counts
   k0 + n blocks as computed (and cached), and it prefills the rest like any other request.
   A pull never fails a request.
Holder (any node): `serve` hashes a peer's lookup (its tokens and salt, with this node's own
hash function: a peer cannot name a block by a hash it merely saw in the index, so another
tenant's salted blocks stay out of reach) and resolves it against the prefix cache, references
the leading run of blocks it holds (so no eviction can reuse them mid-write) and hands the ids to
the connector; `release` drops the references once the worker reports the write done,
failed or expired. With a host tier the run goes on through blocks only the host holds: their
slots are pinned instead and named by the ids past the device's (`KVRegion`'s host slots),
so the peer reads them straight from host memory, no load back to the device first: the
cluster's host tiers are one global pool (not at tensor_parallel_size > 1: there the run stops
at the first block only the host holds, `KVTiers.peer_prefix`). The run is cut to what the
node's pin budget has left (engine/core/pins.py), so a flood of pulls cannot tie up the pool;
the requester computes whatever is not sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.core.hashing import BlockExtra, BlockHasher, HashConfig
from pdcluster.core.kv_connector import KVConnectorScheduler, PrefixTokens, PullLookup, PullResult
from pdcluster.core.kv_transfer import TransferId
from pdcluster.engine.core.block_pool import KVCacheBlock
from pdcluster.engine.core.kv_cache_manager import KVCacheManager, PrefixHit
from pdcluster.engine.core.kv_tiers import HostHit
from pdcluster.engine.core.pins import PinBudget
from pdcluster.engine.core.request import Request

# Blocks of peers' pull lookups hashed per engine step, all lookups together: a peer naming a
# 1M-token prompt costs the engine thread a bounded slice of each step, not one long stall.
MAX_HASH_BLOCKS_PER_STEP = 4096


class PrefixPulls:
    def __init__(self, kv: KVCacheManager, connector: KVConnectorScheduler | None,
                 hash_config: HashConfig, pins: PinBudget,
                 max_hash_blocks_per_step: int = MAX_HASH_BLOCKS_PER_STEP) -> None:
        self.kv = kv
        self.connector = connector
        self.hash_config = hash_config
        self.pins = pins
        self.serving: dict[TransferId, list[PrefixHit]] = {}
        self.pending: dict[TransferId, _Lookup] = {}  # peers' lookups still being hashed
        self.max_hash_blocks_per_step = max_hash_blocks_per_step
        self.num_pulls_skipped = 0  # pulls not made: the pin budget was spent

    # ---- requester ----------------------------------------------------------------------

    def num_pull_tokens(self, req: Request, num_local_blocks: int) -> int:
        """Tokens past the local hit to pull for `req` (whole blocks), 0 to compute them."""
        if req.prefix_pull is None or self.connector is None or not self.kv.enable_caching:
            return 0
        num_full_blocks = (req.num_tokens - 1) // self.kv.block_size
        num_blocks = self.connector.num_pull_blocks(req.request_id, req.prefix_pull,
                                                    num_full_blocks, num_local_blocks)
        if num_blocks and not self.pins.can_hold(num_blocks):
            self.num_pulls_skipped += 1
            return 0  # the node's pin budget is spent: computing is the safe fallback
        return num_blocks * self.kv.block_size

    def on_parked(self, req: Request, num_local_blocks: int) -> None:
        """`req` holds its local hit plus the unhashed blocks the pull is to fill."""
        block_ids = self.kv.block_ids(req.request_id)
        num_tokens = len(block_ids) * self.kv.block_size
        assert num_tokens <= req.num_prompt_tokens, "pulled blocks must be full prompt blocks"
        prefix = PrefixTokens(req.prompt_token_ids[:num_tokens], self.kv.block_size,
                              num_local_blocks, req.extra.cache_salt, req.extra.lora_id)
        assert self.connector is not None and req.prefix_pull is not None, \
            "only a request with a pull and a connector is parked for one (num_pull_tokens)"
        self.pins.hold(("pull", req.request_id), len(block_ids) - num_local_blocks)
        self.connector.on_pull_allocated(req.request_id, req.prefix_pull,
                                         block_ids[num_local_blocks:], prefix)

    def apply_result(self, req: Request, result: PullResult) -> None:
        """Count the blocks that arrived as computed and cached; the rest gets computed."""
        block_size = self.kv.block_size
        num_local = req.num_computed_tokens // block_size
        num_asked = len(self.kv.block_ids(req.request_id)) - num_local
        num_pulled = min(max(result.num_blocks, 0), num_asked) if result.ok else 0
        req.num_computed_tokens = req.num_cached_tokens = (num_local + num_pulled) * block_size
        self.kv.cache_blocks(req, req.num_computed_tokens)
        req.prefix_pull = None
        self.pins.release(("pull", req.request_id))

    # ---- holder -------------------------------------------------------------------------

    def serve(self, lookups: list[PullLookup]) -> None:
        """Take peers' new lookups and hash at most `max_hash_blocks_per_step` blocks of the
        ones waiting (oldest first); each lookup fully hashed is resolved."""
        for lookup in lookups:
            if lookup.transfer_id not in self.serving and lookup.transfer_id not in self.pending:
                self.pending[lookup.transfer_id] = _Lookup.start(
                    lookup, self.kv, self.hash_config)
        budget = self.max_hash_blocks_per_step
        for transfer_id in list(self.pending):
            if budget <= 0:
                break
            waiting = self.pending[transfer_id]
            budget -= waiting.advance(budget, self.kv)
            if waiting.done:
                del self.pending[transfer_id]
                self._resolve(waiting)

    def _resolve(self, lookup: _Lookup) -> None:
        """Reference the leading run of asked blocks still cached, on the device or (with a
        host tier) on the host, within the pin budget."""
        assert self.connector is not None, "pull lookups come from the connector"
        tid = lookup.transfer_id
        hits = _longest_prefix(self.kv, lookup.hashes[lookup.first_block:])
        hits = hits[:self.pins.grant(("serve", tid), len(hits))]
        self.kv.pool.touch([h for h in hits if isinstance(h, KVCacheBlock)])
        host = [h for h in hits if isinstance(h, HostHit)]
        if host and self.kv.tiers is not None:
            self.kv.tiers.pin(host)
        self.serving[tid] = hits
        num_device = self.kv.pool.num_blocks
        self.connector.on_serve(tid, [h.block_id if isinstance(h, KVCacheBlock)
                                      else num_device + h.slot for h in hits])

    def release(self, transfer_ids: list[TransferId]) -> None:
        for transfer_id in transfer_ids:
            if self.pending.pop(transfer_id, None) is not None:
                continue  # expired or aborted while still being hashed: nothing referenced
            hits = self.serving.pop(transfer_id, None) or []
            self.pins.release(("serve", transfer_id))
            host = [h for h in hits if isinstance(h, HostHit)]
            if host and self.kv.tiers is not None:
                self.kv.tiers.unpin(host)
            self.kv.pool.free_blocks(reversed([h for h in hits if isinstance(h, KVCacheBlock)]))


@dataclass(slots=True)
class _Lookup:
    """A peer's lookup being hashed across steps. Hashing stops at the first asked block
    this node does not cache (a chained hash: nothing past it can match), and never goes past
    `first_block` plus this pool's size (no node holds more)."""

    transfer_id: TransferId
    token_ids: list[int]
    block_size: int
    first_block: int
    end_block: int
    hasher: BlockHasher | None
    hashes: list[bytes]
    done: bool = False

    @classmethod
    def start(cls, lookup: PullLookup, kv: KVCacheManager, config: HashConfig) -> _Lookup:
        prefix = lookup.prefix
        hasher = None
        if kv.enable_caching and prefix.block_size == kv.block_size:
            try:
                hasher = BlockHasher(prefix.block_size,
                                     BlockExtra(prefix.cache_salt, prefix.lora_id), config)
            except ValueError:  # a bad key: nothing matches it
                hasher = None
        end_block = min(len(prefix.token_ids) // prefix.block_size,
                        prefix.first_block + kv.pool.num_blocks)
        return cls(lookup.transfer_id, list(prefix.token_ids), prefix.block_size,
                   prefix.first_block, end_block, hasher, [], done=hasher is None)

    def advance(self, budget: int, kv: KVCacheManager) -> int:
        """Hash up to `budget` more blocks; returns how many were hashed."""
        if self.done or self.hasher is None:
            self.done = True
            return 0
        start = len(self.hashes)
        count = min(budget, self.end_block - start)
        size = self.block_size
        try:
            self.hashes += self.hasher.extend(self.token_ids[start * size:(start + count) * size])
        except ValueError:  # a bad token id: no block from here on can match
            self.done = True
            return count
        asked = self.hashes[max(start, self.first_block):]
        if len(_longest_prefix(kv, asked)) < len(asked):
            self.done = True  # a miss: no later block can be served
        self.done = self.done or len(self.hashes) >= self.end_block
        return count


def _longest_prefix(kv: KVCacheManager, hashes: list[bytes]) -> list[PrefixHit]:
    """The leading run of `hashes` this node holds where a peer can read it: the device's,
    then the host tier's (at one tensor-parallel rank only), never the disk's
    (`KVTiers.peer_prefix` says why)."""
    if kv.tiers is not None:
        return kv.tiers.peer_prefix(hashes)
    return list(kv.pool.find_longest_prefix(hashes))
