"""Helpers for transfers between tensor-parallel groups: every copy of every KV head of a
block, gathered from all ranks of an engine (to compare bytes across groups that split the
heads differently), and a rank agent that dies on its first write (a rank killed
mid-transfer), with the transport that hands it to the ranks."""

from __future__ import annotations

import os

from pdcluster.core.kv_ranks import RankAgentSpec, rank_heads
from pdcluster.transfer.rank_agent import MooncakeRankAgent
from pdcluster.transfer.transport import MooncakeTransport


def head_copies(engine, block_id: int) -> dict[int, list[bytes]]:
    """Model KV head -> its bytes of block `block_id` on each rank that holds it (rank order)."""
    ranks = [engine.kv_cache.block_bytes(block_id)]
    if engine.peers is not None:
        ranks += engine.peers.block_bytes(block_id)
    num_heads = engine.model_config.kv_layout[1]
    copies: dict[int, list[bytes]] = {}
    for rank, data in enumerate(ranks):
        held = rank_heads(num_heads, len(ranks), rank)
        chunk = len(data) // len(held)
        for i, head in enumerate(held):
            copies.setdefault(head, []).append(data[i * chunk:(i + 1) * chunk])
    return copies


class DyingRankAgent(MooncakeRankAgent):
    """Exits its rank's process at its first write, as a crash mid-transfer would."""

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        os._exit(17)


class AgentTransport(MooncakeTransport):
    """The real transport whose other ranks run the agent `factory` instead."""

    def __init__(self, factory: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._factory = factory

    def rank_agent(self) -> RankAgentSpec | None:
        spec = super().rank_agent()
        assert spec is not None
        return RankAgentSpec(self._factory, spec.options)
