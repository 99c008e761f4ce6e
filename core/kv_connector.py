"""The KV connector interface between the engine and `transfer/` (torch-free).

Split as in vLLM's KVConnectorBase_V1 (our own version):
- `KVConnectorScheduler` runs with the engine's scheduler. It answers "how many tokens beyond
  my local prefix hit will arrive from outside?", records which local blocks a remote transfer
  must fill, says whether a finished request's blocks stay pinned for a send (delay-free), and
  builds one `ConnectorPlan` per step.
- `KVConnectorWorker` moves the bytes: it registers the engine's whole KV region once,
  executes plans (which it treats as opaque instructions), and reports `ConnectorResults`:
  receives that completed or failed, and pinned requests whose blocks may now be freed.
Only plain data crosses this boundary (ids, block ids, addresses), so the engine needs no
transfer code and the connector no engine code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from core.kv_transfer import KVTransferParams, RemoteDecode, RemotePrefill, TransferId
from core.types import ReqId


@dataclass(frozen=True, slots=True)
class KVRegion:
    """The engine's KV cache as one registered memory region."""

    base_addr: int
    nbytes: int
    block_nbytes: int
    num_blocks: int

    def block_addr(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} outside [0, {self.num_blocks})")
        return self.base_addr + block_id * self.block_nbytes


@dataclass(frozen=True, slots=True)
class RecvJob:
    """D: fill `block_ids[skip_blocks:]` from the prefill node named in `transfer`."""

    request_id: ReqId
    transfer: RemotePrefill
    block_ids: list[int]
    skip_blocks: int


@dataclass(frozen=True, slots=True)
class SendJob:
    """P: prefill is done; `block_ids` are pinned until D's request for them is served."""

    request_id: ReqId
    transfer: RemoteDecode
    block_ids: list[int]
    first_token: int
    first_logprob: float | None = None


@dataclass(slots=True)
class ConnectorPlan:
    recvs: list[RecvJob] = field(default_factory=list)
    sends: list[SendJob] = field(default_factory=list)
    cancelled: list[TransferId] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.recvs or self.sends or self.cancelled)


@dataclass(frozen=True, slots=True)
class RecvResult:
    request_id: ReqId
    ok: bool
    first_token: int | None = None
    first_logprob: float | None = None
    error: str | None = None


@dataclass(slots=True)
class ConnectorResults:
    received: list[RecvResult] = field(default_factory=list)
    released: list[ReqId] = field(default_factory=list)  # P: pinned blocks may be freed


class KVConnectorScheduler(ABC):
    """Scheduler side. `recompute_on_failure`: a failed receive falls back to local prefill
    (True) or fails the request with the transfer's error (False)."""

    recompute_on_failure: bool = True

    @abstractmethod
    def num_external_tokens(self, request_id: ReqId, transfer: KVTransferParams | None,
                            num_tokens: int, num_local_tokens: int) -> int:
        """Tokens beyond the local hit that will arrive asynchronously (0: compute locally)."""

    @abstractmethod
    def on_allocated(self, request_id: ReqId, transfer: RemotePrefill, block_ids: list[int],
                     skip_blocks: int) -> None:
        """D: blocks for the whole prompt exist; `block_ids[skip_blocks:]` await the remote KV."""

    @abstractmethod
    def on_finished(self, request_id: ReqId, transfer: KVTransferParams | None,
                    block_ids: list[int], output_token_ids: list[int],
                    logprobs: list[float]) -> bool:
        """A request finished normally. True: keep its blocks pinned until the worker
        releases them (P waiting to send)."""

    @abstractmethod
    def on_aborted(self, request_id: ReqId, transfer: KVTransferParams | None) -> bool:
        """A request was aborted. True: a transfer may still touch its blocks, keep them
        pinned until the worker reports it (received or released)."""

    @abstractmethod
    def build_plan(self) -> ConnectorPlan:
        """Everything recorded since the last call, for the worker side."""

    @abstractmethod
    def update_from_results(self, results: ConnectorResults) -> None:
        """The worker's results for this step: forget what completed."""


class KVConnectorWorker(ABC):
    @abstractmethod
    def register_kv_region(self, region: KVRegion) -> None: ...

    @abstractmethod
    def execute(self, plan: ConnectorPlan) -> None:
        """Start the plan's work; must not block on remote peers."""

    @abstractmethod
    def get_results(self) -> ConnectorResults:
        """What completed, failed or expired since the last call."""

    @abstractmethod
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class KVConnector:
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
