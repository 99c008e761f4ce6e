"""Scheduler side of the KV connector (torch-free): bookkeeping of which requests receive KV
(decode node) or send it (prefill node), turned into one `ConnectorPlan` per engine step.

- D: a request with `RemotePrefill` needs every prompt token beyond its local prefix hit from
  the prefill node; once its blocks exist, a `RecvJob` asks the worker to fetch them.
- P: a request with `RemoteDecode` that finishes normally is pinned (delay-free) and a
  `SendJob` hands its blocks and first token to the worker.
- Global prefix reuse: a request with a `PrefixPull` hint pulls the blocks past its local hit
  from the holder named in the hint when that saves at least `min_pull_blocks` blocks (the
  threshold: below it, the round trip costs more than computing). A `PullJob` under a fresh
  transfer id asks the worker to fetch them. On a holder, a lookup the engine resolved
  becomes a `ServeJob`.
- Aborts on either side become `cancelled` transfer ids (a request's pull included). A
  cancelled receive or pull stays pinned until the worker reports it (a write into those
  blocks may still be landing); a cancelled send stays pinned until the worker releases it.
"""

from __future__ import annotations

import uuid

from pdcluster.core.kv_connector import (
    ConnectorPlan,
    ConnectorResults,
    KVConnectorScheduler,
    PrefixTokens,
    PullJob,
    RecvJob,
    SendJob,
    ServeJob,
)
from pdcluster.core.kv_transfer import (
    KVTransferParams,
    PrefixPull,
    RemoteDecode,
    RemotePrefill,
    TransferId,
)
from pdcluster.core.types import ReqId

DEFAULT_MIN_PULL_BLOCKS = 2


class ConnectorScheduler(KVConnectorScheduler):
    def __init__(self, recompute_on_failure: bool = True,
                 min_pull_blocks: int = DEFAULT_MIN_PULL_BLOCKS) -> None:
        if min_pull_blocks < 1:
            raise ValueError(f"min_pull_blocks must be >= 1, got {min_pull_blocks}")
        self.recompute_on_failure = recompute_on_failure
        self.min_pull_blocks = min_pull_blocks
        self._receiving: set[ReqId] = set()
        self._sending: set[ReqId] = set()
        self._pulling: dict[ReqId, TransferId] = {}
        self._plan = ConnectorPlan()

    @property
    def receiving(self) -> frozenset[ReqId]:
        """Requests whose KV is on its way from a prefill node."""
        return frozenset(self._receiving)

    @property
    def num_in_flight(self) -> int:
        return len(self._receiving) + len(self._sending) + len(self._pulling)

    def num_external_tokens(self, request_id: ReqId, transfer: KVTransferParams | None,
                            num_tokens: int, num_local_tokens: int) -> int:
        if not isinstance(transfer, RemotePrefill):
            return 0
        return num_tokens - num_local_tokens

    def on_allocated(self, request_id: ReqId, transfer: RemotePrefill, block_ids: list[int],
                     skip_blocks: int) -> None:
        self._receiving.add(request_id)
        self._plan.recvs.append(RecvJob(request_id, transfer, list(block_ids), skip_blocks))

    def num_pull_blocks(self, request_id: ReqId, pull: PrefixPull, num_full_blocks: int,
                        num_local_blocks: int) -> int:
        num_blocks = min(pull.num_blocks, num_full_blocks) - num_local_blocks
        return num_blocks if num_blocks >= self.min_pull_blocks else 0

    def on_pull_allocated(self, request_id: ReqId, pull: PrefixPull, block_ids: list[int],
                          prefix: PrefixTokens) -> None:
        # Unique across requesters: the holder keys its state by transfer id alone.
        transfer_id = f"pull-{uuid.uuid4().hex}"
        self._pulling[request_id] = transfer_id
        self._plan.pulls.append(PullJob(request_id, transfer_id, pull.source_addr,
                                        list(block_ids), prefix, pull.ticket))

    def on_serve(self, transfer_id: TransferId, block_ids: list[int]) -> None:
        self._plan.serves.append(ServeJob(transfer_id, list(block_ids)))

    def on_finished(self, request_id: ReqId, transfer: KVTransferParams | None,
                    block_ids: list[int], output_token_ids: list[int],
                    logprobs: list[float]) -> bool:
        if not isinstance(transfer, RemoteDecode) or not output_token_ids:
            return False
        self._sending.add(request_id)
        first_logprob = logprobs[0] if logprobs else None
        self._plan.sends.append(
            SendJob(request_id, transfer, list(block_ids), output_token_ids[0], first_logprob))
        return True

    def on_aborted(self, request_id: ReqId, transfer: KVTransferParams | None) -> bool:
        pull_id = self._pulling.get(request_id)
        if pull_id is not None:  # the holder may be writing: pinned until it answers
            self._plan.cancelled.append(pull_id)
        if transfer is not None:
            # Also for a prefill request aborted before it finished: D may already be waiting
            # on this transfer id, and the worker answers it with a failure, not silence.
            self._plan.cancelled.append(transfer.transfer_id)
        return (pull_id is not None or request_id in self._receiving
                or request_id in self._sending)

    def build_plan(self) -> ConnectorPlan:
        plan, self._plan = self._plan, ConnectorPlan()
        return plan

    def update_from_results(self, results: ConnectorResults) -> None:
        for result in results.received:
            self._receiving.discard(result.request_id)
        for request_id in results.released:
            self._sending.discard(request_id)
        for pulled in results.pulled:
            self._pulling.pop(pulled.request_id, None)
