"""KV cache events: what a node's block pool reports so the global block index stays exact.

A node records these as blocks enter and leave its prefix cache and publishes them (with
per-node sequence numbers, added by the publisher) to the metadata service.

API: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` and the union ``KVEvent``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.core.types import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A contiguous chain of blocks became cached.

    ``block_hashes[0]``'s parent is ``parent_hash`` (None: the chain starts at the root), and
    each later hash's parent is the one before it.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These blocks were evicted from the prefix cache."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The node dropped its whole prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
