"""`RequestQueues`: where each of the scheduler's requests is, and every move between those
places that is not a step's own scheduling decision (torch-free).

A request is `waiting` (FCFS; preempted ones at the front), `running`, parked in
`waiting_for_remote` while its KV comes from another node, or — finished — `pinned` while a
transfer may still read or write its blocks. This class admits requests (`add_request`),
finishes and fails them (`finish_request`, `fail_request`: blocks freed, or pinned until the
connector releases them, then freed exactly once), applies the stop rules (`_check_stop`), and
carries out the KV connector's side of disaggregated serving:

- A waiting request whose KV comes from a prefill node gets blocks for its whole prompt — its
  local prefix hit plus blocks the transfer fills, left unhashed until the bytes arrive — and
  parks without using the token budget (`_park_for_remote_kv`, called by the scheduler).
  `apply_connector_results` turns an arrival into a running request (prompt computed, first
  token appended) and a failure into a local recompute or an error, by policy.
- Blocks held for other nodes are bounded (engine/core/pins.py): a `RemoteDecode` request that would
  pass the budget is refused at `add_request` (`OverloadedError`), and `expire_pins` cancels
  sends whose decode node has not fetched the blocks within `pin_timeout_s`. The blocks a
  remote prefill parks for the prefill node's write count too: past the budget it waits, and
  one that could never fit computes its prompt here.
- Global prefix reuse (engine/core/prefix_pulls.py) parks a request the same way while blocks past
  its local hit are pulled from another node, and serves other nodes' pulls from this cache.

`Scheduler` (engine/core/scheduler.py) builds on it with the per-step decisions.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from pdcluster.core.hashing import DEFAULT_HASH_CONFIG, HashConfig
from pdcluster.core.kv_connector import (
    ConnectorResults,
    KVConnectorScheduler,
    PullResult,
    RecvResult,
)
from pdcluster.core.kv_transfer import RemoteDecode, RemotePrefill
from pdcluster.core.types import ReqId
from pdcluster.engine.core.kv_cache_manager import KVCacheManager, PrefixHit, cdiv
from pdcluster.engine.core.pins import OverloadedError, PinBudget
from pdcluster.engine.core.prefix_pulls import PrefixPulls
from pdcluster.engine.core.request import Request, RequestStatus
from pdcluster.engine.core.scheduler_output import SchedulerConfig


class RequestQueues:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 connector: KVConnectorScheduler | None = None,
                 hash_config: HashConfig = DEFAULT_HASH_CONFIG,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = kv_manager
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_remote: dict[ReqId, Request] = {}
        self.pinned: dict[ReqId, Request] = {}
        self.pins = PinBudget(config.max_pinned_blocks or kv_manager.pool.num_blocks,
                              config.pin_timeout_s, clock)
        self.pulls = PrefixPulls(kv_manager, connector, hash_config, self.pins)
        self.requests: dict[ReqId, Request] = {}
        self.num_preemptions = 0
        # Prompts this node computes itself (not those whose KV arrives from a prefill node):
        # their tokens, and how many of them its prefix cache held at admission (metrics).
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_remote_prefills_computed = 0  # past the pin budget: prompt computed here

    def add_request(self, req: Request) -> None:
        """Raises ValueError for an id in use, `OverloadedError` for a `RemoteDecode` request
        whose blocks would pass the pin budget."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self._reserve_pins(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _reserve_pins(self, req: Request) -> None:
        if self.connector is None or not isinstance(req.kv_transfer, RemoteDecode):
            return
        # Every block it may hold when it finishes (the last token is never computed).
        num_blocks = cdiv(req.num_tokens + req.params.max_tokens - 1, self.kv.block_size)
        if num_blocks > self.pins.max_blocks:
            self.pins.num_refused += 1
            raise OverloadedError(
                f"a remote_decode request needing {num_blocks} KV blocks is more than this node "
                f"holds for other nodes ({self.pins.max_blocks}): prefill it on its decode "
                "node")
        if not self.pins.try_reserve(("send", req.request_id), num_blocks):
            raise OverloadedError(
                f"this node holds {self.pins.num_used} of at most {self.pins.max_blocks} KV "
                f"blocks for other nodes; a remote_decode request needing {num_blocks} more is "
                f"refused (retry later or on another prefill node)")

    def expire_pins(self) -> None:
        """Cancel the sends pinned past `pin_timeout_s`: the connector releases their blocks
        (at once if the decode node never asked, after the write if one is under way)."""
        for kind, key in self.pins.expired():
            req = self.pinned.get(key)
            if kind == "send" and req is not None:
                self._kv_connector().on_aborted(key, req.kv_transfer)

    def _kv_connector(self) -> KVConnectorScheduler:
        """The connector, on the paths only a request with a transfer or a pull reaches (the
        engine refuses those without a connector, and only they are parked or pinned)."""
        assert self.connector is not None, "KV transfer work on an engine without a connector"
        return self.connector

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _count_prefix_hit(self, req: Request, num_hit_tokens: int) -> None:
        """A prompt computed here met the prefix cache for the first time (a preempted
        request re-admitted is not counted again)."""
        req.num_cached_tokens = num_hit_tokens
        self.num_prefix_queried_tokens += req.num_prompt_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    # ---- KV from other nodes ---------------------------------------------------------------

    def _num_external_tokens(self, req: Request, num_hit_tokens: int) -> int:
        if self.connector is None or not isinstance(req.kv_transfer, RemotePrefill):
            return 0
        if self._remote_blocks(req, num_hit_tokens) > self.pins.max_blocks:
            # it could never be held within the pin budget: compute the prompt here instead
            self.connector.on_aborted(req.request_id, req.kv_transfer)
            req.kv_transfer = None
            self.num_remote_prefills_computed += 1
            return 0
        return self.connector.num_external_tokens(req.request_id, req.kv_transfer,
                                                  req.num_tokens, num_hit_tokens)

    def _remote_blocks(self, req: Request, num_hit_tokens: int) -> int:
        """Blocks a remote prefill holds for the prefill node's write: all past its hit."""
        return cdiv(req.num_tokens, self.kv.block_size) - num_hit_tokens // self.kv.block_size

    def _park_for_remote_kv(self, req: Request, hit_blocks: list[PrefixHit],
                            num_hit_tokens: int, num_external: int) -> bool:
        is_remote_prefill = isinstance(req.kv_transfer, RemotePrefill)
        if is_remote_prefill and not self.pins.can_hold(self._remote_blocks(req,
                                                                            num_hit_tokens)):
            return False  # waits, like a request the pool cannot take yet
        if self.kv.allocate_slots(req, num_external, hit_blocks, delay_caching=True) is None:
            return False
        if is_remote_prefill:
            num_held = len(self.kv.block_ids(req.request_id)) - len(hit_blocks)
            self.pins.hold(("recv", req.request_id), num_held)
        self.waiting.popleft()
        if req.num_cached_tokens < 0 and not isinstance(req.kv_transfer, RemotePrefill):
            self._count_prefix_hit(req, num_hit_tokens)  # a prefix pull: computes the rest
        req.num_computed_tokens = req.num_cached_tokens = num_hit_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[req.request_id] = req
        if isinstance(req.kv_transfer, RemotePrefill):
            self._kv_connector().on_allocated(req.request_id, req.kv_transfer,
                                              self.kv.block_ids(req.request_id), len(hit_blocks))
        else:
            self.pulls.on_parked(req, len(hit_blocks))
        return True

    def apply_connector_results(self, results: ConnectorResults) -> list[Request]:
        """Arrivals and failures of remote KV and of pulls, releases of pinned blocks, and
        other nodes' pulls to serve."""
        self._kv_connector().update_from_results(results)
        for pulled in results.pulled:
            req = self.waiting_for_remote.get(pulled.request_id)
            if req is None:
                self._release(pulled.request_id)  # aborted while in flight: now safe
            else:
                self._pull_done(req, pulled)
        self.pulls.serve(results.lookups)
        self.pulls.release(results.served)
        updated: list[Request] = []
        for result in results.received:
            req = self.waiting_for_remote.get(result.request_id)
            if req is None:
                self._release(result.request_id)  # aborted while in flight: now safe
            elif result.ok:
                updated.append(self._remote_kv_arrived(req, result))
            elif self._remote_kv_failed(req, result.error):
                updated.append(req)
        for request_id in results.released:
            self._release(request_id)
        return updated

    def _remote_kv_arrived(self, req: Request, result: RecvResult) -> Request:
        assert result.first_token is not None, "an arrival of remote KV carries the first token"
        del self.waiting_for_remote[req.request_id]
        self.pins.release(("recv", req.request_id))  # its blocks are its own now
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_blocks(req, req.num_tokens)
        req.append_output_token(result.first_token, result.first_logprob)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        status = self._check_stop(req)
        if status is not None:
            self.finish_request(req.request_id, status)
        return req

    def _pull_done(self, req: Request, result: PullResult) -> None:
        del self.waiting_for_remote[req.request_id]
        self.pulls.apply_result(req, result)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _remote_kv_failed(self, req: Request, error: str | None) -> bool:
        """Recompute locally (returns False: nothing to report yet) or fail (True)."""
        if self._kv_connector().recompute_on_failure:
            del self.waiting_for_remote[req.request_id]
            self.kv.free(req)
            self.pins.release(("recv", req.request_id))
            req.num_computed_tokens = 0
            req.kv_transfer = None
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
            return False
        req.error = f"KV transfer failed: {error}"
        self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
        return True

    def _release(self, request_id: ReqId) -> None:
        req = self.pinned.pop(request_id, None)
        if req is not None:
            self.kv.free(req)
            self.pins.release_request(request_id)

    # ---- finishing -------------------------------------------------------------------------

    def fail_request(self, req: Request, error: str) -> None:
        """Finish `req` alone with finish_reason "error" (its blocks freed or, while a
        transfer may use them, pinned); a request that already finished keeps its blocks'
        fate and only reports the error."""
        req.error = error
        if self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR) is None:
            req.status = RequestStatus.FINISHED_ERROR

    def _check_stop(self, req: Request) -> RequestStatus | None:
        token, p = req.output_token_ids[-1], req.params
        is_stop = token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids)
        if is_stop and req.num_output_tokens >= p.min_tokens:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: ReqId, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is and free its blocks — or pin them while
        a transfer may use them. Idempotent; aborting a pinned request cancels its send."""
        req = self.requests.pop(request_id, None)
        if req is None:
            pinned = self.pinned.get(request_id)
            if pinned is not None and status is RequestStatus.FINISHED_ABORTED:
                self._kv_connector().on_aborted(request_id, pinned.kv_transfer)
            return None
        self._remove_from_queue(req)
        req.status = status
        if self._must_pin(req):
            self.pinned[request_id] = req
            self.pins.start_clock(("send", request_id))
        else:
            self.kv.free(req)
            self.pins.release_request(request_id)
        return req

    def _remove_from_queue(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            del self.waiting_for_remote[req.request_id]
        else:
            self.waiting.remove(req)

    def _must_pin(self, req: Request) -> bool:
        if self.connector is None:
            return False
        if req.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return self.connector.on_aborted(req.request_id, req.kv_transfer)
        return self.connector.on_finished(req.request_id, req.kv_transfer,
                                          self.kv.block_ids(req.request_id),
                                          req.output_token_ids, req.logprobs)
