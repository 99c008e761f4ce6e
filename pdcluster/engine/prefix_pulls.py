"""Global prefix reuse, the engine's half (torch-free): pulling a prompt's cached prefix from
another node instead of computing it, and serving such pulls to other nodes.

Requester (a request with a `PrefixPull` hint, admitted from the waiting queue):
1. Its local prefix hit is k0 blocks; the hint names a holder with k blocks. The connector
   decides how many to pull (`num_pull_blocks`: its threshold; never the block holding the
   last prompt token). If any, the scheduler allocates blocks [k0, k) unhashed and parks the
   request in `WAITING_FOR_REMOTE_KVS`; `on_parked` hands the connector their ids and what
   names them (`PrefixTokens`: the prompt's leading tokens and its cache salt). The parked
   blocks count against the node's pin budget (engine/pins.py); a pull that does not fit is
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
failed or expired. The run is cut to what the node's pin budget has left (engine/pins.py),
so a flood of pulls cannot tie up the pool; the requester computes whatever is not sent.
"""

from __future__ import annotations

from pdcluster.core.hashing import BlockExtra, HashConfig, hash_block_tokens
from pdcluster.core.kv_connector import KVConnectorScheduler, PrefixTokens, PullLookup, PullResult
from pdcluster.core.kv_transfer import TransferId
from pdcluster.engine.block_pool import KVCacheBlock
from pdcluster.engine.kv_cache_manager import KVCacheManager
from pdcluster.engine.pins import PinBudget
from pdcluster.engine.request import Request


class PrefixPulls:
    def __init__(self, kv: KVCacheManager, connector: KVConnectorScheduler | None,
                 hash_config: HashConfig, pins: PinBudget) -> None:
        self.kv = kv
        self.connector = connector
        self.hash_config = hash_config
        self.pins = pins
        self.serving: dict[TransferId, list[KVCacheBlock]] = {}
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
        if not lookups:
            return
        assert self.connector is not None, "pull lookups come from the connector"
        for lookup in lookups:
            if lookup.transfer_id in self.serving:
                continue  # the worker never asks twice; never reference twice either
            blocks: list[KVCacheBlock] = []
            if self.kv.enable_caching and lookup.prefix.block_size == self.kv.block_size:
                blocks = self.kv.pool.find_longest_prefix(self._hashes(lookup.prefix))
            blocks = blocks[:self.pins.grant(("serve", lookup.transfer_id), len(blocks))]
            self.kv.pool.touch(blocks)
            self.serving[lookup.transfer_id] = blocks
            self.connector.on_serve(lookup.transfer_id, [b.block_id for b in blocks])

    def _hashes(self, prefix: PrefixTokens) -> list[bytes]:
        try:
            extra = BlockExtra(prefix.cache_salt, prefix.lora_id)
            hashes = hash_block_tokens(prefix.token_ids, prefix.block_size, extra,
                                       self.hash_config)
        except ValueError:  # a bad token id or key: nothing matches it
            return []
        return hashes[prefix.first_block:]

    def release(self, transfer_ids: list[TransferId]) -> None:
        for transfer_id in transfer_ids:
            blocks = self.serving.pop(transfer_id, None)
            self.pins.release(("serve", transfer_id))
            if blocks:
                self.kv.pool.free_blocks(reversed(blocks))
