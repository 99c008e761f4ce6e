"""vLLM's KV cache events, as the node's: a subscriber thread on vLLM's event publisher.

vLLM's engine core publishes `KVEventBatch`es (BlockStored / BlockRemoved / AllBlocksCleared)
on a ZMQ PUB socket, each with a sequence number, and keeps the recent ones for replay on a
ROUTER socket. Both endpoints are `ipc://` paths in the node's private folder (handshake.py).
This thread subscribes, asks for a replay whenever a sequence number is skipped (a PUB socket
drops messages when a subscriber is slow, and a new subscriber misses what came before it),
converts each event to `core.events`, and keeps the set of block hashes the engine holds —
what the node reports when the metadata service asks for a snapshot. Block hashes arrive as
the 32 bytes of vLLM's `sha256_cbor` digest (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`, set by
`engine.py`), the same bytes `core.vllm_hashing` computes.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared
from vllm.distributed.kv_events import BlockRemoved as VllmRemoved
from vllm.distributed.kv_events import BlockStored as VllmStored
from vllm.distributed.kv_events import KVEventBatch

from pdcluster.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdcluster.core.types import BlockHash

logger = logging.getLogger(__name__)
_END_SEQ = -1
_REPLAY_TIMEOUT_MS = 2000


class EventSubscriber:
    """Subscribes to vLLM's KV events at `endpoint` (replays from `replay_endpoint`)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "kv") -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []
        self._cached: set[BlockHash] = set()
        self._next_seq = 0
        self.num_bad_batches = 0
        self.num_replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm-kv-events")
        self._thread.start()

    def take(self) -> list[KVEvent]:
        """The events converted since the last call, in order."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def note_cleared(self) -> None:
        """The engine dropped its prefix cache. vLLM publishes AllBlocksCleared with its next
        step's events only — on an idle engine, not until the next request — so the node
        reports it now; vLLM's own copy, when it comes, clears an already empty set."""
        with self._lock:
            self._cached.clear()
            self._events.append(AllBlocksCleared())

    def cached_hashes(self) -> list[BlockHash]:
        with self._lock:
            return list(self._cached)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close()

    def _run(self) -> None:
        self._replay_from(0)  # whatever was published before this socket joined
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                _, seq_bytes, payload = self._sub.recv_multipart()
            except ValueError:
                self.num_bad_batches += 1
                continue
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq > self._next_seq:
                self._replay_from(self._next_seq)  # a gap: fetch what was dropped
            if seq >= self._next_seq:
                self._apply(seq, payload)

    def _replay_from(self, start: int) -> None:
        """Apply the publisher's buffered batches from `start` on (its replay socket)."""
        self.num_replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, _REPLAY_TIMEOUT_MS)
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                _, _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == _END_SEQ:
                    return
                if seq >= self._next_seq:
                    self._apply(seq, payload)
        except zmq.Again:
            logger.warning("vLLM's KV event replay did not answer; the index may lag until "
                           "the metadata service resyncs this node")
        except ValueError:
            self.num_bad_batches += 1
        finally:
            sock.close()

    def _apply(self, seq: int, payload: bytes) -> None:
        self._next_seq = seq + 1
        try:
            batch = self._decoder.decode(payload)
            converted = [event for raw in batch.events if (event := _convert(raw)) is not None]
        except (msgspec.DecodeError, ValueError) as exc:
            self.num_bad_batches += 1  # counted and logged, never fatal
            logger.warning("a KV event batch from vLLM was dropped: %s", exc)
            return
        with self._lock:
            for event in converted:
                _update(self._cached, event)
            self._events.extend(converted)


def _convert(raw: object) -> KVEvent | None:
    if isinstance(raw, VllmStored):
        hashes = tuple(_as_bytes(h) for h in raw.block_hashes)
        parent = _as_bytes(raw.parent_block_hash) if raw.parent_block_hash is not None else None
        return BlockStored(hashes, parent, raw.block_size)
    if isinstance(raw, VllmRemoved):
        return BlockRemoved(tuple(_as_bytes(h) for h in raw.block_hashes))
    if isinstance(raw, VllmCleared):
        return AllBlocksCleared()
    return None


def _as_bytes(block_hash: bytes | int) -> BlockHash:
    if isinstance(block_hash, int):  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES left on: refuse
        raise ValueError("vLLM publishes integer block hashes; the node needs the digest "
                         "bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)")
    return bytes(block_hash)


def _update(cached: set[BlockHash], event: KVEvent) -> None:
    if isinstance(event, BlockStored):
        cached.update(event.block_hashes)
    elif isinstance(event, BlockRemoved):
        cached.difference_update(event.block_hashes)
    else:
        cached.clear()
