"""The KV connector across a tensor-parallel group (torch-free): what passes between the engine,
which owns the ranks, and the connector, which moves their bytes.

With tensor parallelism each rank's process holds its own KV cache: the same block ids as rank
0, its own KV heads (`rank_heads`: `num_kv_heads / tp` each, or one replicated head each when
there are fewer heads than ranks; MLA's latent counts as one head that every rank holds). So
every rank registers its own region with its own transfer engine and moves its own bytes,
while rank 0 keeps the side channel and plans every rank's share of a transfer.

- `RankAgentSpec`: how a rank's process builds the connector's part there, a `KVRankAgent`
  (an installed module path, `"pkg.module:Class"`, and plain keyword options); the connector
  worker names it (`KVConnectorWorker.rank_agent`), the engine builds it in each rank
  (`load_rank_agent`).
- `KVRankAgent`: that part, in the process of rank r >= 1: registers the rank's KV region with
  the rank's own transfer engine, and writes the descriptors rank 0 planned for it.
- `KVRanks`: rank 0's handle on ranks 1..N-1, which the engine builds and hands the connector
  worker with its region: each rank's transfer-engine session and region base address, and
  `write(rank, ...)`, a future that fails if the rank fails or dies.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pdcluster.core.kv_region import KVRegion


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The model's KV heads rank `rank` of `tp_size` holds, as the engine splits them
    (engine/models/parallel.py, `head_slice`): a contiguous `num_kv_heads / tp_size` of them,
    or, with fewer heads than ranks, the one head `rank * num_kv_heads // tp_size`."""
    if not 0 <= rank < tp_size or num_kv_heads < 1:
        raise ValueError(f"rank {rank} of {tp_size}, {num_kv_heads} KV heads")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        per = num_kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    if tp_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated over {tp_size} ranks")
    head = rank * num_kv_heads // tp_size
    return range(head, head + 1)


@dataclass(frozen=True, slots=True)
class RankAgentSpec:
    """`factory` ("pkg.module:Class", an installed name) called with `options` (plain data:
    it crosses to the rank's process as msgpack)."""

    factory: str
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        module, _, name = self.factory.partition(":")
        if not module or not name:
            raise ValueError(f"a rank agent factory is 'module:Class', got {self.factory!r}")


class KVRankAgent(ABC):
    """The connector in a tensor-parallel rank's own process (ranks 1..N-1)."""

    @abstractmethod
    def register(self, region: KVRegion) -> str:
        """Register this rank's KV region with its transfer engine; its session (what peers
        and rank 0's plans address it by)."""

    @abstractmethod
    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Write local bytes into peer `session`'s memory; raises on failure."""

    @abstractmethod
    def close(self) -> None: ...


def load_rank_agent(spec: RankAgentSpec) -> KVRankAgent:
    """Build the agent `spec` names (in the rank's process)."""
    module, _, name = spec.factory.partition(":")
    agent = getattr(importlib.import_module(module), name)(**spec.options)
    if not isinstance(agent, KVRankAgent):
        raise TypeError(f"{spec.factory} built a {type(agent).__name__}, not a KVRankAgent")
    return agent


@dataclass(frozen=True, slots=True)
class RankEndpoint:
    """Where a rank's KV lives for peers: its transfer-engine session and its region's base
    address (its blocks lie at rank 0's offsets from there), its host tier's (0: none;
    host slots lie at rank 0's slot offsets from there), and where its segments lie from
    that base (one per layer in vLLM's layout, each rank's own)."""

    session: str
    base_addr: int
    host_addr: int = 0
    segment_offsets: tuple[int, ...] = (0,)


class KVRanks(ABC):
    """Rank 0's handle on ranks 1..N-1 (their agents registered)."""

    @property
    @abstractmethod
    def endpoints(self) -> list[RankEndpoint]:
        """Ranks 1..N-1, in rank order."""

    @abstractmethod
    def write(self, rank: int, session: str, src: list[int], dst: list[int],
              lengths: list[int]) -> Future[None]:
        """Rank `rank` (>= 1) writes its bytes `src` into peer `session`'s `dst`; the future
        fails if the write fails or the rank dies first."""
