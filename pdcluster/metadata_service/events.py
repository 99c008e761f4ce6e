"""Block events between ``core.events`` and the wire: encoding on the node side, validation
and decoding on the service side. A batch is validated whole before anything is applied.

Media (KV tiers, ``core.events``): a stored event names the medium of the new copies
(unspecified on the wire: the device), a removal the copies that went (unspecified: every
copy), a move both ends; ``medium_to_pb`` / ``medium_from_pb`` map the names.

API: ``Op``, ``Change``, ``encode_events`` (core events -> protobuf), ``decode_events``
(protobuf -> [Change], raising ``InvalidBatch`` with a precise message); the other requests'
checks: ``check_node_info``, ``unpack_snapshot`` (hashes and their media masks),
``unpack_query``; ``medium_to_pb``, ``medium_from_pb``.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdcluster.core.block_index import MEDIUM_BITS
from pdcluster.core.events import (
    DEVICE,
    DISK,
    HOST,
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from pdcluster.core.types import MAX_ADDRESS_CHARS, BlockHash
from pdcluster.metadata_service.codec import pack_hashes, unpack_hashes
from pdcluster.metadata_service.config import MetadataConfig
from pdcluster.metadata_service.errors import InvalidBatch
from pdcluster.metadata_service.identities import check_curve_key
from pdcluster.proto import metadata_pb2 as pb

_NODE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_MAX_MODEL_CHARS = 4096
_MAX_IDENTITY_CHARS = 256  # each of a node's hash_algorithm, hash_seed, tokenizer_digest


_TO_PB: dict[str | None, pb.Medium] = {None: pb.MEDIUM_UNSPECIFIED, DEVICE: pb.MEDIUM_DEVICE,
                                       HOST: pb.MEDIUM_HOST, DISK: pb.MEDIUM_DISK}
_FROM_PB: dict[int, str | None] = {int(value): name for name, value in _TO_PB.items()}
_ALL_MEDIA = sum(MEDIUM_BITS.values())


def medium_to_pb(medium: str | None) -> pb.Medium:
    return _TO_PB[medium]


def medium_from_pb(value: int, where: str) -> str | None:
    """The medium a wire value names (None: unspecified); InvalidBatch for an unknown one."""
    if value not in _FROM_PB:
        raise InvalidBatch("bad_medium", f"{where}: unknown medium {value}")
    return _FROM_PB[value]


class Op(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    MOVED = "moved"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class Change:
    """One decoded event: STORED on ``medium`` (None: the device), REMOVED from ``medium``
    (None: every copy), MOVED from ``src`` to ``medium``, or CLEARED."""

    op: Op
    block_hashes: list[BlockHash]
    medium: str | None = None
    src: str | None = None


def encode_events(events: Iterable[KVEvent]) -> list[pb.KVEventMsg]:
    out: list[pb.KVEventMsg] = []
    for event in events:
        if isinstance(event, BlockStored):
            out.append(pb.KVEventMsg(stored=pb.BlockStoredEvent(
                block_hashes=pack_hashes(event.block_hashes),
                parent_hash=event.parent_hash or b"",
                block_size=event.block_size,
                medium=medium_to_pb(None if event.medium == DEVICE else event.medium),
            )))
        elif isinstance(event, BlockRemoved):
            out.append(pb.KVEventMsg(removed=pb.BlockRemovedEvent(
                block_hashes=pack_hashes(event.block_hashes),
                medium=medium_to_pb(event.medium))))
        elif isinstance(event, BlockMoved):
            out.append(pb.KVEventMsg(moved=pb.BlockMovedEvent(
                block_hashes=pack_hashes(event.block_hashes), src=medium_to_pb(event.src),
                dst=medium_to_pb(event.dst))))
        elif isinstance(event, AllBlocksCleared):
            out.append(pb.KVEventMsg(cleared=pb.AllBlocksClearedEvent()))
        else:
            raise TypeError(f"not a KV event: {event!r}")
    return out


def decode_events(events: Sequence[pb.KVEventMsg], config: MetadataConfig) -> list[Change]:
    if len(events) > config.max_batch_events:
        raise InvalidBatch("too_many_events", f"batch has {len(events)} events, more than "
                           f"max_batch_events={config.max_batch_events}")
    changes: list[Change] = []
    num_hashes = 0
    for i, event in enumerate(events):
        changes.append(_decode_event(i, event, config.hash_size))
        num_hashes += len(changes[-1].block_hashes)
        if num_hashes > config.max_batch_hashes:
            raise InvalidBatch("too_many_hashes", f"batch has more than max_batch_hashes="
                               f"{config.max_batch_hashes} hashes")
    return changes


def _decode_event(i: int, event: pb.KVEventMsg, size: int) -> Change:
    kind = event.WhichOneof("kind")
    where = f"event {i}"
    if kind == "stored":
        stored = event.stored
        if len(stored.parent_hash) not in (0, size):
            raise InvalidBatch("bad_parent_hash", f"{where}: parent_hash has "
                               f"{len(stored.parent_hash)} bytes, expected 0 or {size}")
        hashes = unpack_hashes(stored.block_hashes, size, f"{where} block_hashes")
        if not hashes:
            raise InvalidBatch("empty_event", f"{where}: a stored event with no hashes")
        return Change(Op.STORED, hashes, medium_from_pb(stored.medium, where) or DEVICE)
    if kind == "removed":
        hashes = unpack_hashes(event.removed.block_hashes, size, f"{where} block_hashes")
        return Change(Op.REMOVED, hashes, medium_from_pb(event.removed.medium, where))
    if kind == "moved":
        moved = event.moved
        src, dst = medium_from_pb(moved.src, where), medium_from_pb(moved.dst, where)
        if src is None or dst is None:
            raise InvalidBatch("bad_medium", f"{where}: a move needs both media")
        hashes = unpack_hashes(moved.block_hashes, size, f"{where} block_hashes")
        return Change(Op.MOVED, hashes, dst, src)
    if kind == "cleared":
        return Change(Op.CLEARED, [])
    raise InvalidBatch("missing_event_kind", f"{where}: no event kind set")


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
    for name in ("hash_algorithm", "hash_seed", "tokenizer_digest"):
        if len(getattr(info, name)) > _MAX_IDENTITY_CHARS:
            raise InvalidBatch("bad_identity", f"node {info.node_id}: {name} is longer than "
                               f"{_MAX_IDENTITY_CHARS} characters")
    check_curve_key(info.curve_public_key, f"node {info.node_id}")


def unpack_snapshot(packed: bytes, config: MetadataConfig, media: bytes = b""
                    ) -> tuple[list[BlockHash], dict[BlockHash, int]]:
    """The snapshot's hashes and the media masks of those not on the device alone."""
    if len(packed) > config.max_snapshot_hashes * config.hash_size:
        raise InvalidBatch("snapshot_too_large", f"snapshot of {len(packed) // config.hash_size} "
                           f"blocks exceeds max_snapshot_hashes={config.max_snapshot_hashes}")
    hashes = unpack_hashes(packed, config.hash_size)
    if not media:
        return hashes, {}
    if len(media) != len(hashes):
        raise InvalidBatch("bad_media", f"snapshot has {len(hashes)} hashes but "
                           f"{len(media)} media masks")
    if any(mask == 0 or mask & ~_ALL_MEDIA for mask in media):
        raise InvalidBatch("bad_media", "a snapshot media mask names no medium or an unknown "
                           "one")
    device = MEDIUM_BITS[DEVICE]
    return hashes, {h: mask for h, mask in zip(hashes, media, strict=True) if mask != device}


def unpack_query(packed: bytes, config: MetadataConfig) -> list[BlockHash]:
    if len(packed) > config.max_query_blocks * config.hash_size:
        raise InvalidBatch("query_too_long",
                           f"query chain exceeds max_query_blocks={config.max_query_blocks}")
    return unpack_hashes(packed, config.hash_size)
