"""`MooncakeRankAgent`: the connector in the process of tensor-parallel rank r >= 1
(core.kv_ranks). It runs that rank's own Mooncake transfer engine (one per process, bound to
the node's host like rank 0's), registers the rank's KV region, and writes what rank 0 planned
for it. It holds no side channel: rank 0 speaks for the group."""

from __future__ import annotations

from pdcluster.core.kv_connector import KVRegion
from pdcluster.core.kv_ranks import KVRankAgent
from pdcluster.transfer.mooncake_engine import P2P_HANDSHAKE, MooncakeConfig, MooncakeTransferEngine


class MooncakeRankAgent(KVRankAgent):
    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_name: str = "", metadata_server: str = P2P_HANDSHAKE) -> None:
        self._engine = MooncakeTransferEngine(MooncakeConfig(hostname, protocol, device_name,
                                                             metadata_server))

    def register(self, region: KVRegion) -> str:
        for addr, nbytes in region.memory_ranges():
            self._engine.register(addr, nbytes)
        return self._engine.session_id

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        self._engine.write(session, src, dst, lengths)

    def close(self) -> None:
        self._engine.close()
