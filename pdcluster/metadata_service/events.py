"""Block events between ``core.events`` and the wire: encoding on the node side, validation
and decoding on the service side. A batch is validated whole before anything is applied.

API: ``Op``, ``encode_events`` (core events -> protobuf), ``decode_events`` (protobuf ->
[(Op, hashes)], raising ``InvalidBatch`` with a precise message); the other requests' checks:
``check_node_info``, ``unpack_snapshot``, ``unpack_query``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence

from pdcluster.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdcluster.core.types import MAX_ADDRESS_CHARS, BlockHash
from pdcluster.metadata_service.codec import pack_hashes, unpack_hashes
from pdcluster.metadata_service.config import MetadataConfig
from pdcluster.metadata_service.errors import InvalidBatch
from pdcluster.metadata_service.identities import check_curve_key
from pdcluster.proto import metadata_pb2 as pb

_NODE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_MAX_MODEL_CHARS = 4096


class Op(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


def encode_events(events: Iterable[KVEvent]) -> list[pb.KVEventMsg]:
    out: list[pb.KVEventMsg] = []
    for event in events:
        if isinstance(event, BlockStored):
            out.append(pb.KVEventMsg(stored=pb.BlockStoredEvent(
                block_hashes=pack_hashes(event.block_hashes),
                parent_hash=event.parent_hash or b"",
                block_size=event.block_size,
            )))
        elif isinstance(event, BlockRemoved):
            out.append(pb.KVEventMsg(removed=pb.BlockRemovedEvent(
                block_hashes=pack_hashes(event.block_hashes))))
        elif isinstance(event, AllBlocksCleared):
            out.append(pb.KVEventMsg(cleared=pb.AllBlocksClearedEvent()))
        else:
            raise TypeError(f"not a KV event: {event!r}")
    return out


def decode_events(
    events: Sequence[pb.KVEventMsg], config: MetadataConfig
) -> list[tuple[Op, list[BlockHash]]]:
    if len(events) > config.max_batch_events:
        raise InvalidBatch("too_many_events", f"batch has {len(events)} events, more than "
                           f"max_batch_events={config.max_batch_events}")
    size = config.hash_size
    ops: list[tuple[Op, list[BlockHash]]] = []
    num_hashes = 0
    for i, event in enumerate(events):
        kind = event.WhichOneof("kind")
        if kind == "stored":
            stored = event.stored
            if len(stored.parent_hash) not in (0, size):
                raise InvalidBatch("bad_parent_hash", f"event {i}: parent_hash has "
                                   f"{len(stored.parent_hash)} bytes, expected 0 or {size}")
            hashes = unpack_hashes(stored.block_hashes, size, f"event {i} block_hashes")
            if not hashes:
                raise InvalidBatch("empty_event", f"event {i}: a stored event with no hashes")
            ops.append((Op.STORED, hashes))
        elif kind == "removed":
            hashes = unpack_hashes(event.removed.block_hashes, size, f"event {i} block_hashes")
            ops.append((Op.REMOVED, hashes))
        elif kind == "cleared":
            ops.append((Op.CLEARED, []))
        else:
            raise InvalidBatch("missing_event_kind", f"event {i}: no event kind set")
        num_hashes += len(ops[-1][1])
        if num_hashes > config.max_batch_hashes:
            raise InvalidBatch("too_many_hashes", f"batch has more than max_batch_hashes="
                               f"{config.max_batch_hashes} hashes")
    return ops


def check_node_info(info: pb.NodeInfo) -> None:
    if not _NODE_ID.fullmatch(info.node_id):
        raise InvalidBatch("bad_node_id",
                           f"node_id {info.node_id!r} must match {_NODE_ID.pattern}")
    if info.role not in (pb.PREFILL, pb.DECODE):
        raise InvalidBatch("bad_role", f"node {info.node_id}: role must be PREFILL or DECODE")
    for name in ("request_address", "kv_address", "kv_session", "metrics_address"):
        if len(getattr(info, name)) > MAX_ADDRESS_CHARS:
            raise InvalidBatch("bad_address", f"node {info.node_id}: {name} is longer than "
                               f"{MAX_ADDRESS_CHARS} characters")
    if len(info.model) > _MAX_MODEL_CHARS:
        raise InvalidBatch("bad_model", f"node {info.node_id}: model is longer than "
                           f"{_MAX_MODEL_CHARS} characters")
    check_curve_key(info.curve_public_key, f"node {info.node_id}")


def unpack_snapshot(packed: bytes, config: MetadataConfig) -> list[BlockHash]:
    if len(packed) > config.max_snapshot_hashes * config.hash_size:
        raise InvalidBatch("snapshot_too_large", f"snapshot of {len(packed) // config.hash_size} "
                           f"blocks exceeds max_snapshot_hashes={config.max_snapshot_hashes}")
    return unpack_hashes(packed, config.hash_size)


def unpack_query(packed: bytes, config: MetadataConfig) -> list[BlockHash]:
    if len(packed) > config.max_query_blocks * config.hash_size:
        raise InvalidBatch("query_too_long",
                           f"query chain exceeds max_query_blocks={config.max_query_blocks}")
    return unpack_hashes(packed, config.hash_size)
