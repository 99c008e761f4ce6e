"""Scheduler side of the KV connector (torch-free): bookkeeping of which requests receive KV
(decode node) or send it (prefill node), turned into one `ConnectorPlan` per engine step.

- D: a request with `RemotePrefill` needs every prompt token beyond its local prefix hit from
  the prefill node; once its blocks exist, a `RecvJob` asks the worker to fetch them.
- P: a request with `RemoteDecode` that finishes normally is pinned (delay-free) and a
  `SendJob` hands its blocks and first token to the worker.
- Aborts on either side become `cancelled` transfer ids. A cancelled receive stays pinned
  until the worker reports it (a write into those blocks may still be landing); a cancelled
  send stays pinned until the worker releases it.
"""

from __future__ import annotations

from core.kv_connector import (
    ConnectorPlan,
    ConnectorResults,
    KVConnectorScheduler,
    RecvJob,
    SendJob,
)
from core.kv_transfer import KVTransferParams, RemoteDecode, RemotePrefill
from core.types import ReqId


class ConnectorScheduler(KVConnectorScheduler):
    def __init__(self, recompute_on_failure: bool = True) -> None:
        self.recompute_on_failure = recompute_on_failure
        self._receiving: set[ReqId] = set()
        self._sending: set[ReqId] = set()
        self._plan = ConnectorPlan()

    @property
    def num_in_flight(self) -> int:
        return len(self._receiving) + len(self._sending)

    def num_external_tokens(self, request_id: ReqId, transfer: KVTransferParams | None,
                            num_tokens: int, num_local_tokens: int) -> int:
        if not isinstance(transfer, RemotePrefill):
            return 0
        return num_tokens - num_local_tokens

    def on_allocated(self, request_id: ReqId, transfer: RemotePrefill, block_ids: list[int],
                     skip_blocks: int) -> None:
        self._receiving.add(request_id)
        self._plan.recvs.append(RecvJob(request_id, transfer, list(block_ids), skip_blocks))

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
        if transfer is None:
            return False
        # Also for a prefill request aborted before it finished: D may already be waiting on
        # this transfer id, and the worker answers it with a failure instead of silence.
        self._plan.cancelled.append(transfer.transfer_id)
        return request_id in self._receiving or request_id in self._sending

    def build_plan(self) -> ConnectorPlan:
        plan, self._plan = self._plan, ConnectorPlan()
        return plan

    def update_from_results(self, results: ConnectorResults) -> None:
        for result in results.received:
            self._receiving.discard(result.request_id)
        for request_id in results.released:
            self._sending.discard(request_id)
