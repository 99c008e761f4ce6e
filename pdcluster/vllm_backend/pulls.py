"""Global prefix reuse between vLLM nodes, on the connector's scheduler side: pulling a
prompt's cached prefix from the node that holds it instead of computing it.

- **Requester.** A request whose `kv_transfer_params` carry a pull hint
  (`{"pull": {"source_addr", "num_blocks"}}`, from the router's `PrefixSource`) asks vLLM for
  the blocks past its local hit that the holder has (never the block of the last prompt
  token), if `ConnectorScheduler.num_pull_blocks` says they are worth the round trip; once
  vLLM has allocated them they become a `PullJob`, named by the prompt's tokens and cache salt.
  The holder may send fewer: the worker reports the rest as load errors and vLLM computes them.
- **Holder.** A peer's pull reaches this node's worker, which hands it up as a `PullLookup`
  (worker metadata); here its tokens are hashed as vLLM hashes them, the leading run of those
  blocks still in vLLM's prefix cache is referenced (`BlockPool.touch`, so nothing evicts them
  mid-write) and handed back as a `ServeJob`; when the worker reports the write served, the
  references are dropped. vLLM's engine sleeps when it has no requests, so the worker wakes it
  (handshake.py's `wake` socket, through the node) and tells this side a lookup is coming
  (`lookups` socket), which keeps the engine stepping until the lookup is answered.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from pdcluster.core.hashing import BlockExtra, HashConfig, hash_block_tokens
from pdcluster.core.kv_connector import PrefixTokens, PullLookup
from pdcluster.core.kv_transfer import PrefixPull, TransferId
from pdcluster.core.pull_ticket import ticket_from_dict
from pdcluster.transfer.connector_scheduler import ConnectorScheduler

PULL_KEY = "pull"
# How long a lookup announced by the worker keeps the engine stepping before it shows up in
# the worker's results (it normally does within a step or two).
_ANNOUNCED_S = 2.0


def pull_hint(params: dict[str, Any] | None) -> PrefixPull | None:
    hint = (params or {}).get(PULL_KEY)
    if not hint:
        return None
    ticket = hint.get("ticket")
    return PrefixPull(str(hint["source_addr"]), int(hint["num_blocks"]),
                      None if ticket is None else ticket_from_dict(ticket))


class VllmPulls:
    def __init__(self, sched: ConnectorScheduler, block_size: int, hash_config: HashConfig,
                 lookups_endpoint: str | None) -> None:
        self.sched, self.block_size, self.hash_config = sched, block_size, hash_config
        self._pool: Any = None  # vLLM's BlockPool, bound once the cache manager exists
        self._wanted: dict[str, tuple[PrefixPull, int, int]] = {}  # rid -> (hint, local, n)
        # Requests that pulled once: a pull that came back short is computed, never retried
        # (vLLM asks again after it recovers from the missing blocks).
        self._tried: set[str] = set()
        self._serving: dict[TransferId, list[Any]] = {}  # referenced blocks per serve
        self._announced_until = 0.0
        self._notices: zmq.Socket[bytes] | None = None
        if lookups_endpoint is not None:
            self._notices = zmq.Context.instance().socket(zmq.PULL)
            self._notices.setsockopt(zmq.LINGER, 0)
            self._notices.bind(lookups_endpoint)

    def bind_pool(self, pool: Any) -> None:
        self._pool = pool

    # ---- requester --------------------------------------------------------------------

    def num_new_tokens(self, request: Any, num_computed_tokens: int) -> int:
        hint = pull_hint(request.kv_transfer_params)
        if hint is None or request.request_id in self._wanted or request.request_id in self._tried:
            return 0
        num_local = num_computed_tokens // self.block_size
        num_full = (request.num_prompt_tokens - 1) // self.block_size
        num_blocks = self.sched.num_pull_blocks(request.request_id, hint, num_full, num_local)
        if num_blocks <= 0:
            return 0
        self._wanted[request.request_id] = (hint, num_local, num_blocks)
        return num_blocks * self.block_size

    def on_allocated(self, request: Any, block_ids: list[int], num_external: int) -> bool:
        """True if the request's external tokens were a pull (now planned)."""
        wanted = self._wanted.pop(request.request_id, None)
        if wanted is None:
            return False
        hint, num_local, num_blocks = wanted
        self._tried.add(request.request_id)
        if num_external <= 0:
            return True
        end = (num_local + num_blocks) * self.block_size
        prefix = PrefixTokens(list(request.prompt_token_ids[:end]), self.block_size, num_local,
                              request.cache_salt)
        self.sched.on_pull_allocated(request.request_id, hint,
                                     block_ids[num_local:num_local + num_blocks], prefix)
        return True

    def forget(self, request_id: str) -> None:
        self._wanted.pop(request_id, None)
        self._tried.discard(request_id)

    # ---- holder -----------------------------------------------------------------------

    def serve(self, lookups: list[PullLookup]) -> None:
        """Reference the blocks each lookup names and plan their writes."""
        for lookup in lookups:
            blocks = self._cached_run(lookup.prefix)
            if blocks:
                self._pool.touch(blocks)
            self._serving[lookup.transfer_id] = blocks
            self.sched.on_serve(lookup.transfer_id, [b.block_id for b in blocks])
        self._announced_until = 0.0 if lookups else self._announced_until

    def _cached_run(self, prefix: PrefixTokens) -> list[Any]:
        if self._pool is None or prefix.block_size != self.block_size or prefix.lora_id:
            return []
        chain = hash_block_tokens(prefix.token_ids, self.block_size,
                                  BlockExtra(cache_salt=prefix.cache_salt), self.hash_config)
        run = []
        for block_hash in chain[prefix.first_block:]:
            cached = self._pool.get_cached_block(block_hash, [0])
            if cached is None:
                break
            run.append(cached[0])
        return run

    def served(self, transfer_ids: list[TransferId]) -> None:
        for tid in transfer_ids:
            blocks = self._serving.pop(tid, None)
            if blocks:
                self._pool.free_blocks(blocks)

    def has_pending_work(self) -> bool:
        """Serves in flight, or a lookup the worker announced and has not handed up yet."""
        if self._notices is not None:
            try:
                while True:
                    self._notices.recv(zmq.NOBLOCK)
                    self._announced_until = time.monotonic() + _ANNOUNCED_S
            except zmq.Again:
                pass
        return bool(self._serving) or time.monotonic() < self._announced_until

    def close(self) -> None:
        if self._notices is not None:
            self._notices.close()
