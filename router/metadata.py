"""The router's thin client of the metadata service, over the generated gRPC stubs in
`proto/` (the router may not import `metadata_service`: two services never import each other).

`MetadataLink.prefix_hits(chain)` asks which nodes hold how many leading blocks. When the
service cannot be reached (or answers too slowly), the link goes *degraded*: it returns no
hits (the policy then routes on load alone), stops asking for `retry_s`, and recovers on the
first successful query after that. `available`, `failures` and `last_error` feed /health
and /metrics. `list_nodes()` is node discovery.

API: `MetadataLink`, `PrefixHits`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import grpc

from core.types import BlockHash, NodeId
from proto import metadata_pb2 as pb
from proto import metadata_pb2_grpc as pb_grpc
from router.config import NodeSpec

logger = logging.getLogger(__name__)

PrefixHits = dict[NodeId, int]
_ROLE_NAMES = {pb.PREFILL: "prefill", pb.DECODE: "decode"}


class MetadataLink:
    def __init__(self, address: str, *, token: str | None = None, timeout_s: float = 0.5,
                 retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.available = True
        self.failures = 0
        self.last_error = ""
        self._clock = clock
        self._retry_at = 0.0
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.MetadataServiceStub(self._channel)

    async def prefix_hits(self, chain: Sequence[BlockHash]) -> PrefixHits | None:
        """Leading blocks held per node; None when degraded (route on load alone)."""
        if not chain:
            return {}
        if not self.available and self._clock() < self._retry_at:
            return None
        request = pb.QueryRequest(block_hashes=b"".join(chain))
        try:
            reply = await self._stub.Query(request, timeout=self.timeout_s,
                                           metadata=self._metadata)
        except grpc.RpcError as exc:
            self._fail(exc)
            return None
        self._recover()
        return {m.node_id: m.num_blocks for m in reply.matches}

    async def list_nodes(self) -> list[NodeSpec] | None:
        try:
            reply = await self._stub.ListNodes(pb.ListNodesRequest(), timeout=self.timeout_s,
                                               metadata=self._metadata)
        except grpc.RpcError as exc:
            self._fail(exc)
            return None
        self._recover()
        return [NodeSpec(n.node_id, _ROLE_NAMES.get(n.role, "both"), n.request_address,
                         n.kv_address) for n in reply.nodes if n.request_address]

    def _fail(self, exc: grpc.RpcError) -> None:
        if self.available:
            logger.error("metadata service %s unreachable, routing on load only: %s",
                         self.address, exc.code().name)
        self.available = False
        self.failures += 1
        self.last_error = f"{exc.code().name}: {exc.details()}"
        self._retry_at = self._clock() + self.retry_s

    def _recover(self) -> None:
        if not self.available:
            logger.warning("metadata service %s is back: prefix-aware routing", self.address)
        self.available = True
        self.last_error = ""

    async def close(self) -> None:
        await self._channel.close()
