"""The KV connector interface between the engine and `transfer/` (torch-free).

Split as in vLLM's KVConnectorBase_V1 (our own version):
- `KVConnectorScheduler` runs with the engine's scheduler. It answers "how many tokens beyond
  my local prefix hit will arrive from outside?", records which local blocks a remote transfer
  must fill, says whether a finished request's blocks stay pinned for a send (delay-free), and
  builds one `ConnectorPlan` per step. For global prefix reuse it also decides whether a
  `PrefixPull` hint is worth following (`num_pull_blocks`, the threshold is its policy).
- `KVConnectorWorker` moves the bytes: it registers the engine's whole KV region once,
  executes plans (which it treats as opaque instructions), and reports `ConnectorResults`:
  receives and pulls that completed or failed, pinned requests whose blocks may now be freed,
  and on a holder node the pull requests of peers (`lookups`), which only the engine can
  resolve against its prefix cache, and the served pulls whose blocks may be unreferenced.
Only plain data crosses this boundary (ids, block ids, addresses), so the engine needs no
transfer code and the connector no engine code. The KV region a worker registers is
core/kv_region.py's `KVRegion` (re-exported here); tensor-parallel ranks are core/kv_ranks.py.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

from pdcluster.core.kv_ranks import KVRanks, RankAgentSpec
from pdcluster.core.kv_region import KVRegion
from pdcluster.core.kv_transfer import (
    KVTransferParams,
    PrefixPull,
    RemoteDecode,
    RemotePrefill,
    TransferId,
)
from pdcluster.core.pull_ticket import PullTicket
from pdcluster.core.types import ReqId

__all__ = ["ConnectorPlan", "ConnectorResults", "KVConnector", "KVConnectorScheduler",
           "KVConnectorWorker", "KVRegion", "PrefixTokens", "PullJob", "PullLookup",
           "PullResult", "RecvJob", "RecvResult", "SendJob", "ServeJob", "TransferTiming"]


class TransferTiming(NamedTuple):
    """One finished transfer as the node's metrics and spans see it: `kind` send (P's
    write), recv (D's request to done) or pull (a prefix pull, request to done)."""

    kind: str
    seconds: float
    request_id: ReqId = ""
    ended_ns: int = 0  # wall clock (time.time_ns) when it finished: 0 if unknown

    @classmethod
    def now(cls, kind: str, seconds: float, request_id: ReqId) -> TransferTiming:
        return cls(kind, seconds, request_id, time.time_ns())


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


@dataclass(frozen=True, slots=True)
class PrefixTokens:
    """What names a prompt's blocks [first_block, len(token_ids) // block_size) to a holder:
    the tokens of every block up to the last one (from block 0: hashes chain) and the extra
    keys of their hashes. The holder hashes them itself, so a requester must know the prompt
    and its cache salt; a block hash seen in the index opens nothing."""

    token_ids: list[int]
    block_size: int
    first_block: int
    cache_salt: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class PullJob:
    """Requester: fill `block_ids` (blocks [k0, k) of the prompt, named by `prefix`) from the
    holder at `source_addr`; the holder may send only a leading part of them."""

    request_id: ReqId
    transfer_id: TransferId
    source_addr: str
    block_ids: list[int]
    prefix: PrefixTokens
    ticket: PullTicket | None = None  # the router's, forwarded to the holder


@dataclass(frozen=True, slots=True)
class ServeJob:
    """Holder: the engine resolved lookup `transfer_id`; `block_ids` (possibly none) are the
    leading run of the asked hashes it holds, referenced until the worker reports `served`."""

    transfer_id: TransferId
    block_ids: list[int]


@dataclass(slots=True)
class ConnectorPlan:
    recvs: list[RecvJob] = field(default_factory=list)
    sends: list[SendJob] = field(default_factory=list)
    cancelled: list[TransferId] = field(default_factory=list)
    pulls: list[PullJob] = field(default_factory=list)
    serves: list[ServeJob] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.recvs or self.sends or self.cancelled or self.pulls or self.serves)


@dataclass(frozen=True, slots=True)
class RecvResult:
    request_id: ReqId
    ok: bool
    first_token: int | None = None
    first_logprob: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PullResult:
    """Requester: `num_blocks` leading blocks of the pull's `block_ids` hold the holder's KV
    (0 on failure: the engine computes them)."""

    request_id: ReqId
    ok: bool
    num_blocks: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PullLookup:
    """Holder: a peer asks for the blocks `prefix` names; the engine answers with a
    `ServeJob`."""

    transfer_id: TransferId
    prefix: PrefixTokens


@dataclass(slots=True)
class ConnectorResults:
    received: list[RecvResult] = field(default_factory=list)
    released: list[ReqId] = field(default_factory=list)  # P: pinned blocks may be freed
    pulled: list[PullResult] = field(default_factory=list)
    lookups: list[PullLookup] = field(default_factory=list)
    served: list[TransferId] = field(default_factory=list)  # holder: unreference the blocks


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
    def num_pull_blocks(self, request_id: ReqId, pull: PrefixPull, num_full_blocks: int,
                        num_local_blocks: int) -> int:
        """Blocks past the local hit to pull from `pull.source_addr` (0: compute them).
        `num_full_blocks`: the prompt's blocks that may come from elsewhere (never the one
        holding the last prompt token, whose logits the first sample needs)."""

    @abstractmethod
    def on_pull_allocated(self, request_id: ReqId, pull: PrefixPull, block_ids: list[int],
                          prefix: PrefixTokens) -> None:
        """Requester: `block_ids` (unhashed, named by `prefix`) await the pulled KV."""

    @abstractmethod
    def on_serve(self, transfer_id: TransferId, block_ids: list[int]) -> None:
        """Holder: lookup `transfer_id` resolved to `block_ids`, referenced for the write."""

    @abstractmethod
    def on_finished(self, request_id: ReqId, transfer: KVTransferParams | None,
                    block_ids: list[int], output_token_ids: list[int],
                    logprobs: list[float]) -> bool:
        """A request finished normally. True: keep its blocks pinned until the worker
        releases them (P waiting to send)."""

    @abstractmethod
    def on_aborted(self, request_id: ReqId, transfer: KVTransferParams | None) -> bool:
        """A request was aborted. True: a transfer (or a pull) may still touch its blocks,
        keep them pinned until the worker reports it (received, pulled or released)."""

    @abstractmethod
    def build_plan(self) -> ConnectorPlan:
        """Everything recorded since the last call, for the worker side."""

    @abstractmethod
    def update_from_results(self, results: ConnectorResults) -> None:
        """The worker's results for this step: forget what completed."""


class KVConnectorWorker(ABC):
    @abstractmethod
    def register_kv_region(self, region: KVRegion, ranks: KVRanks | None = None) -> None:
        """Register the engine's KV region (rank 0's, with tensor parallelism; `ranks` are
        the others, their agents' regions registered by the engine: core.kv_ranks)."""

    def rank_agent(self) -> RankAgentSpec | None:
        """What each tensor-parallel rank's process runs of this connector
        (core.kv_ranks); None: this connector cannot span ranks (the engine refuses
        tensor parallelism with it)."""
        return None

    @abstractmethod
    def execute(self, plan: ConnectorPlan) -> None:
        """Start the plan's work; must not block on remote peers."""

    @abstractmethod
    def get_results(self) -> ConnectorResults:
        """What completed, failed or expired since the last call."""

    @abstractmethod
    def has_pending_work(self) -> bool:
        """Whether the engine must step for the worker's sake (a peer's pull to look up)."""

    def counters(self) -> dict[str, int]:
        """Running totals of the transfers (blocks, bytes, outcomes) by name, for node
        metrics; none by default."""
        return {}

    def take_latencies(self) -> list[TransferTiming]:
        """The transfers finished since the last call, for node metrics and spans; none by
        default."""
        return []

    def fail_receive(self, transfer_id: TransferId, reason: str) -> bool:
        """Give up on receive `transfer_id` now: its source is known to be dead (its
        connection closed), so no byte of it will land. It is reported failed with `reason`
        at the next `get_results`, as a timeout would be, only sooner. False when no such
        receive is waiting: one not started yet fails as soon as it starts, one already
        done is left alone. None of this by default."""
        return False

    @abstractmethod
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class KVConnector:
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
