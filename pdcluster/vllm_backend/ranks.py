"""The connector across vLLM's tensor-parallel worker processes (core.kv_ranks over ZMQ).

vLLM builds the worker side of pdcluster's connector in every tensor-parallel rank's process.
Rank 0 is the node's connector (side channel, plans, results, as at TP=1); each rank r >= 1
runs only a `RankServer`: its own Mooncake engine with its own KV slice registered, answering
rank 0 on `ipc://<handshake folder>/rank-<r>` (the node's private folder, mode 0700):

- `EndpointAsk` -> `EndpointReply`: the rank's transfer-engine session, its region's base
  and its segments' offsets (one segment per layer), which rank 0 names in its requests so
  that peers write each rank's heads into that rank's memory;
- `WriteAsk` -> `WriteReply`: write these local bytes into peer `session` (what rank 0
  planned for this rank, transfer/head_map.py).

`RankClients` is rank 0's `KVRanks` over those sockets: it waits for every rank's endpoint
as the caches are registered (vLLM registers them in all ranks at once) and runs each write
as a round trip of its own. Messages are msgpack through the project's typed codec
(core.wire), never pickle. A rank that dies takes vLLM's whole engine down (vLLM's executor
watches its workers); until then a write it never answers fails at rank 0's timeout.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

import zmq

from pdcluster.core.kv_ranks import KVRankAgent, KVRanks, RankEndpoint
from pdcluster.core.kv_region import KVRegion
from pdcluster.core.kv_transfer import MAX_ERROR_CHARS, Address, Segments
from pdcluster.core.wire import MaxLen, Protocol, WireError
from pdcluster.transfer.errors import TransferError, error_text
from pdcluster.vllm_backend.handshake import endpoint

logger = logging.getLogger(__name__)

RANK_WIRE_VERSION = 1
_MAX_DESCRIPTORS = 1 << 22  # blocks x layers of one write, far above any transfer's
Descriptors = Annotated[list[int], MaxLen(_MAX_DESCRIPTORS)]
_POLL_MS = 100  # how often a server checks that it should stop


@dataclass(frozen=True, slots=True)
class EndpointAsk:
    rank: int


@dataclass(frozen=True, slots=True)
class EndpointReply:
    session: Address
    base_addr: int
    segment_offsets: Segments


@dataclass(frozen=True, slots=True)
class WriteAsk:
    session: Address
    src: Descriptors
    dst: Descriptors
    lengths: Descriptors


@dataclass(frozen=True, slots=True)
class WriteReply:
    ok: bool
    error: Annotated[str, MaxLen(MAX_ERROR_CHARS)] | None = None


_PROTOCOL = Protocol(RANK_WIRE_VERSION, (EndpointAsk, EndpointReply, WriteAsk, WriteReply),
                     3 * 9 * _MAX_DESCRIPTORS + (1 << 16))


def rank_endpoint(folder: str, rank: int) -> str:
    return endpoint(folder, f"rank-{rank}")


class RankServer:
    """Rank r >= 1: registers `region` with `agent` and answers rank 0 from a thread."""

    def __init__(self, folder: str, rank: int, agent: KVRankAgent, region: KVRegion) -> None:
        self._agent = agent
        session = agent.register(region)
        self._endpoint = EndpointReply(session, region.base_addr, list(region.segment_offsets))
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(rank_endpoint(folder, rank))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"kv-rank-{rank}")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                continue
            data = self._sock.recv()
            try:
                reply = self._answer(_PROTOCOL.decode(data))
            except WireError as exc:
                reply = WriteReply(False, f"malformed request: {exc}")
            self._sock.send(_PROTOCOL.encode(reply))

    def _answer(self, msg: object) -> EndpointReply | WriteReply:
        if isinstance(msg, EndpointAsk):
            return self._endpoint
        if not isinstance(msg, WriteAsk):
            return WriteReply(False, f"unexpected {type(msg).__name__}")
        try:
            self._agent.write(msg.session, msg.src, msg.dst, msg.lengths)
        except Exception as exc:  # rank 0 reports it; the requester recomputes
            logger.warning("tensor-parallel rank write to %s failed: %s", msg.session, exc)
            return WriteReply(False, error_text(exc)[:MAX_ERROR_CHARS])
        return WriteReply(True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_MS / 1000)
        self._sock.close()
        self._agent.close()


class RankClients(KVRanks):
    """Rank 0's handle on ranks 1..`tp_size`-1 (their servers in `folder`)."""

    def __init__(self, folder: str, tp_size: int, timeout_s: float) -> None:
        self._folder, self._timeout_s = folder, timeout_s
        self._pool = ThreadPoolExecutor(max(1, 2 * (tp_size - 1)),
                                        thread_name_prefix="kv-rank-write")
        self._endpoints = [self._ask_endpoint(rank) for rank in range(1, tp_size)]

    @property
    def endpoints(self) -> list[RankEndpoint]:
        return self._endpoints

    def write(self, rank: int, session: str, src: list[int], dst: list[int],
              lengths: list[int]) -> Future[None]:
        return self._pool.submit(self._write, rank, WriteAsk(session, src, dst, lengths))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _ask_endpoint(self, rank: int) -> RankEndpoint:
        reply = self._call(rank, EndpointAsk(rank))
        assert isinstance(reply, EndpointReply), type(reply)
        return RankEndpoint(reply.session, reply.base_addr,
                            segment_offsets=tuple(reply.segment_offsets))

    def _write(self, rank: int, ask: WriteAsk) -> None:
        reply = self._call(rank, ask)
        if not isinstance(reply, WriteReply) or not reply.ok:
            raise TransferError(getattr(reply, "error", None) or "unexpected reply")

    def _call(self, rank: int, msg: EndpointAsk | WriteAsk) -> object:
        """One round trip on a socket of its own (one per call: threads never share one)."""
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(rank_endpoint(self._folder, rank))
            sock.send(_PROTOCOL.encode(msg))
            if not sock.poll(int(self._timeout_s * 1000)):
                raise TransferError(f"tensor-parallel rank {rank} did not answer in "
                                    f"{self._timeout_s:g} s")
            return _PROTOCOL.decode(sock.recv())
        finally:
            sock.close()
