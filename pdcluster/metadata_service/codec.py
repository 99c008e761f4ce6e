"""Packing of block hashes on the wire and in etcd, and the persisted delta record.

Block hashes travel packed: one ``bytes`` of concatenated fixed-size digests. This keeps a
batch of thousands of hashes one protobuf field (no per-element framing or objects).

API: ``pack_hashes``, ``unpack_hashes``, ``Delta``, ``encode_delta``, ``decode_delta``,
``encode_record``, ``decode_record``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from pdcluster.core.types import BlockHash
from pdcluster.metadata_service.errors import InvalidBatch

_DELTA_VERSION = 1


def pack_hashes(block_hashes: Iterable[BlockHash]) -> bytes:
    return b"".join(block_hashes)


def unpack_hashes(data: bytes, hash_size: int, what: str = "block_hashes") -> list[BlockHash]:
    """Split packed hashes; a length that is not a multiple of ``hash_size`` is malformed."""
    if len(data) % hash_size:
        raise InvalidBatch(
            "bad_hash_length",
            f"{what} has {len(data)} bytes, not a multiple of the {hash_size}-byte hash size",
        )
    return [data[i:i + hash_size] for i in range(0, len(data), hash_size)]


@dataclass(slots=True)
class Delta:
    """A node's block-set change since the last flush, coalesced: ``added`` and ``removed``
    are disjoint, and ``cleared`` means "drop everything first"."""

    epoch: int = 0
    seq: int = 0
    cleared: bool = False
    added: set[BlockHash] = field(default_factory=set)
    removed: set[BlockHash] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.cleared or self.added or self.removed)

    def add(self, block_hashes: Iterable[BlockHash]) -> None:
        for block_hash in block_hashes:
            self.removed.discard(block_hash)
            self.added.add(block_hash)

    def remove(self, block_hashes: Iterable[BlockHash]) -> None:
        for block_hash in block_hashes:
            self.added.discard(block_hash)
            self.removed.add(block_hash)

    def clear(self) -> None:
        self.cleared = True
        self.added.clear()
        self.removed.clear()

    def apply_to(self, block_set: set[BlockHash]) -> None:
        if self.cleared:
            block_set.clear()
        block_set -= self.removed
        block_set |= self.added


def encode_delta(delta: Delta, writer: str) -> bytes:
    return msgpack.packb({
        "v": _DELTA_VERSION, "w": writer, "e": delta.epoch, "s": delta.seq,
        "c": delta.cleared, "a": pack_hashes(delta.added), "r": pack_hashes(delta.removed),
    })


def decode_delta(data: bytes, hash_size: int) -> tuple[Delta, str]:
    """The delta and the replica that wrote it."""
    raw = msgpack.unpackb(data)
    if raw.get("v") != _DELTA_VERSION:
        raise ValueError(f"unsupported delta version {raw.get('v')!r}")
    delta = Delta(epoch=raw["e"], seq=raw["s"], cleared=raw["c"],
                  added=set(unpack_hashes(raw["a"], hash_size)),
                  removed=set(unpack_hashes(raw["r"], hash_size)))
    return delta, raw["w"]


def encode_record(fields: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb({"v": _DELTA_VERSION, **fields})
    return data


def decode_record(data: bytes) -> dict[str, Any]:
    raw = msgpack.unpackb(data)
    if not isinstance(raw, dict):
        raise ValueError(f"a record must be a map, got {type(raw).__name__}")
    if raw.get("v") != _DELTA_VERSION:
        raise ValueError(f"unsupported record version {raw.get('v')!r}")
    return raw
