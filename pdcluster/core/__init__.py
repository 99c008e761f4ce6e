"""Torch-free shared kernel of pdcluster: ids, the block-hash function and KV cache events."""

from pdcluster.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdcluster.core.hashing import (
    DEFAULT_HASH_CONFIG,
    NO_EXTRA,
    BlockExtra,
    BlockHasher,
    HashConfig,
    hash_block,
    hash_block_tokens,
    root_hash,
)
from pdcluster.core.types import BlockHash, BlockId, NodeId, ReqId, TokenId

__all__ = [
    "DEFAULT_HASH_CONFIG",
    "NO_EXTRA",
    "AllBlocksCleared",
    "BlockExtra",
    "BlockHash",
    "BlockHasher",
    "BlockId",
    "BlockRemoved",
    "BlockStored",
    "HashConfig",
    "KVEvent",
    "NodeId",
    "ReqId",
    "TokenId",
    "hash_block",
    "hash_block_tokens",
    "root_hash",
]
