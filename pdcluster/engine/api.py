"""`NodeEngine`: what a node needs of an LLM engine, and all it may ask of one.

A node (`pdcluster.node`) serves one engine behind this interface and never asks which engine
it is: the project's own torch engine (`engine.llm_engine.LLMEngine`) or vLLM
(`pdcluster.vllm_backend.VllmEngine`). Everything here is called from the node's one engine
thread, except `cached_block_hashes`, which the metadata publisher calls from its own thread.

- `submit` admits a request (prompt token ids, the wire's `SamplingSpec`, the KV transfer it
  takes part in, a prefix-pull hint); it raises `ValueError` for a request the engine refuses
  and `engine.core.pins.OverloadedError` when it has no room now. `abort_request` ends one.
- `step` advances the engine and returns each request's new tokens (`RequestOutput`); a node
  calls it while `has_unfinished_requests()` or `has_pinned_blocks()`.
- `load`, `counters`, `take_step_times`, `transfer_counters`, `take_transfer_latencies` and
  `pool_state` feed load reports, metrics and leak checks; `kv_costs` (what the engine
  measured about KV it loads instead of computing: its KV tiers) rides on load reports.
- `take_kv_events` and `cached_block_hashes` feed the global block index, with hashes computed
  as `hash_config` says (the router hashes prompts the same way).

`step` raising `EngineFailure` (engine/core/failures.py) means the engine itself is lost (a
tensor-parallel rank died or stalled): no later step can succeed, and the node fails its
requests and exits so that it is restarted. Any other exception from `step` fails that step's
requests only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from pdcluster.core.events import KVEvent
from pdcluster.core.hashing import HashConfig
from pdcluster.core.kv_connector import TransferTiming
from pdcluster.core.kv_transfer import KVTransferParams, PrefixPull, TransferId
from pdcluster.core.node_wire import KVCosts
from pdcluster.core.sampling import SamplingSpec
from pdcluster.core.types import BlockHash, ReqId
from pdcluster.engine.core.failures import EngineFailure
from pdcluster.engine.core.outputs import EngineCounters, EngineLoad, RequestOutput

__all__ = ["EngineFailure", "NodeEngine"]


class NodeEngine(ABC):
    """The engine a node serves (see the module docstring)."""

    @property
    @abstractmethod
    def block_size(self) -> int:
        """Tokens per KV block: the unit of the prefix cache and of every transfer."""

    @property
    @abstractmethod
    def num_kv_blocks(self) -> int:
        """KV blocks in the engine's pool (its capacity, for the router)."""

    @property
    @abstractmethod
    def hash_config(self) -> HashConfig:
        """How this engine names its blocks; the router must hash prompts the same way."""

    @property
    @abstractmethod
    def accepts_prefix_pulls(self) -> bool:
        """Whether a `PrefixPull` hint can be followed (a KV connector is attached)."""

    def prepare(self, sampling: SamplingSpec) -> Future[None] | None:
        """Start what admitting a request with `sampling` needs that may be slow (compiling
        its grammar) off the caller's thread: a future to wait for before `submit`, or None
        when nothing is needed. ValueError (refused) / OverloadedError (no room now)."""
        return None

    @abstractmethod
    def submit(self, request_id: ReqId, prompt_token_ids: list[int], sampling: SamplingSpec,
               *, cache_salt: str | None = None, kv_transfer: KVTransferParams | None = None,
               prefix_pull: PrefixPull | None = None) -> None:
        """Admit a request, or raise ValueError (refused) / OverloadedError (no room now)."""

    @abstractmethod
    def abort_request(self, request_id: ReqId) -> bool:
        """End a request; False if the engine does not know it (finished or never admitted)."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Run once; the outputs of every request that produced tokens or finished."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def has_runnable_requests(self) -> bool:
        """Whether `step` has work now (the node then polls its socket without waiting)."""

    @abstractmethod
    def has_pinned_blocks(self) -> bool:
        """Whether blocks are held for a peer (a send or a served pull not yet done)."""

    @abstractmethod
    def load(self) -> EngineLoad: ...

    @abstractmethod
    def counters(self) -> EngineCounters: ...

    @abstractmethod
    def take_step_times(self) -> list[float]:
        """Durations of the steps since the last call, in seconds."""

    @abstractmethod
    def transfer_counters(self) -> dict[str, int]:
        """Running totals of the KV connector's transfers by name ({} without one)."""

    @abstractmethod
    def take_transfer_latencies(self) -> list[TransferTiming]:
        """The transfers finished since the last call (kind, seconds, request, end time)."""

    def kv_source_lost(self, transfer_id: TransferId, reason: str) -> bool:
        """The prefill node that was to send transfer `transfer_id`'s KV is gone: stop
        waiting for it and compute the prompt (or fail the request, by policy) at the next
        step. False where there is no such receive waiting (it then fails when it starts),
        or where the engine cannot be told (by default: it waits out its KV timeout)."""
        return False

    def kv_costs(self) -> KVCosts | None:
        """The engine's measured prefill rate and KV tier costs for the router (None by
        default: nothing measured; the router prices with its fallback weights)."""
        return None

    def recent_write_times(self) -> list[float]:
        """Durations of this node's recent KV writes to peers, in seconds (none by
        default: an engine whose connector keeps no such record)."""
        return []

    @abstractmethod
    def pool_state(self) -> dict[str, int]:
        """For leak checks: `num_free_blocks`, `num_blocks`, `num_held_blocks` (referenced by
        a request or a peer), `num_pinned_requests`, `num_unfinished`."""

    @abstractmethod
    def take_kv_events(self) -> list[KVEvent]:
        """Block events since the last call, in order."""

    @abstractmethod
    def cached_block_hashes(self) -> list[BlockHash]:
        """Every block hash the prefix cache holds now (any thread)."""

    def cached_block_media(self) -> list[BlockHash] | dict[BlockHash, int]:
        """What a snapshot for the metadata service holds: every cached hash, or, for an
        engine with KV tiers, each hash -> its media mask (1 device, 2 host, 4 disk). Any
        thread. By default: the hashes, all on the device."""
        return self.cached_block_hashes()

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False (nothing dropped) while requests hold blocks."""

    @abstractmethod
    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """What a node reports about its engine (name and version), for logs and metrics."""
        return {"backend": type(self).__name__}
