"""The one block-hash function of the cluster.

Nodes, router and metadata service must agree bit for bit on the hash of a block, so this
module owns the whole definition: a chained hash over full blocks,

    h_0 = H(ROOT_TAG || root_seed)                    (root_hash, the parent of block 0)
    h_i = H(BLOCK_TAG || h_{i-1} || n || tokens_i || extra)

with every integer packed little-endian at a fixed width and the extra keys (cache salt, LoRA
id) encoded with presence flags and length prefixes, so that no two distinct inputs share an
encoding. Nothing process-dependent (Python's ``hash()``, native byte order) enters the digest.

API: ``HashConfig``, ``BlockExtra``, ``DEFAULT_HASH_CONFIG``, ``NO_EXTRA``, ``root_hash``,
``hash_block``, ``hash_block_tokens`` and the incremental ``BlockHasher``.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdcluster.core.types import BlockHash
from pdcluster.core.vllm_hashing import VLLM_HASH_ALGORITHM, vllm_block_hash, vllm_root_hash

# Bump the version whenever the encoding below changes: hashes live in the global index and
# in every node's prefix cache, and a silent change would make old and new nodes disagree.
_ENCODING_VERSION = 1
_ROOT_TAG = bytes([(_ENCODING_VERSION << 4) | 0x0])
_BLOCK_TAG = bytes([(_ENCODING_VERSION << 4) | 0x1])
_HAS_SALT = 0x1
_HAS_LORA = 0x2

# VLLM_HASH_ALGORITHM is vLLM's own chain (core/vllm_hashing.py), for nodes that run vLLM.
_DIGEST_SIZES = {"sha256": 32, "xxh3_128": 16, VLLM_HASH_ALGORITHM: 32}


@dataclass(frozen=True, slots=True)
class HashConfig:
    """Which hash function and which root seed; every process of a cluster must share it."""

    algorithm: str = "sha256"
    root_seed: str = "pdcluster-v1"

    def __post_init__(self) -> None:
        if self.algorithm not in _DIGEST_SIZES:
            raise ValueError(
                f"unknown hash algorithm {self.algorithm!r}; expected one of "
                f"{sorted(_DIGEST_SIZES)}"
            )
        if not self.root_seed:
            raise ValueError("root_seed must be a non-empty string")

    @property
    def is_vllm(self) -> bool:
        return self.algorithm == VLLM_HASH_ALGORITHM

    @property
    def digest_size(self) -> int:
        return _DIGEST_SIZES[self.algorithm]


@dataclass(frozen=True, slots=True)
class BlockExtra:
    """Extra keys mixed into every block hash: different salts or LoRAs never share a block."""

    cache_salt: str | None = None
    lora_id: int | None = None

    def __post_init__(self) -> None:
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a str, got {type(self.cache_salt).__name__}")
        if self.lora_id is not None and not 0 <= self.lora_id < 2**63:
            raise ValueError(f"lora_id must be in [0, 2**63), got {self.lora_id}")


DEFAULT_HASH_CONFIG = HashConfig()
NO_EXTRA = BlockExtra()


@functools.cache
def _digest_fn(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm == "xxh3_128":
        # Imported lazily so that SHA-256 users need nothing beyond the standard library.
        import xxhash

        return xxhash.xxh3_128_digest
    return lambda data: hashlib.sha256(data).digest()


# Bounded: salts can be per tenant or even per request, and the router is long-lived.
@functools.lru_cache(maxsize=4096)
def _encode_extra(extra: BlockExtra) -> bytes:
    flags = 0
    parts: list[bytes] = []
    if extra.cache_salt is not None:
        flags |= _HAS_SALT
        salt = extra.cache_salt.encode("utf-8")
        parts.append(struct.pack("<I", len(salt)) + salt)
    if extra.lora_id is not None:
        flags |= _HAS_LORA
        parts.append(struct.pack("<q", extra.lora_id))
    return bytes([flags]) + b"".join(parts)


def _pack_tokens(token_ids: Sequence[int], prefix: tuple[int, ...] = ()) -> bytes:
    # struct checks type and range in C: no Python-level loop over the tokens.
    try:
        return struct.pack(f"<{len(prefix) + len(token_ids)}I", *prefix, *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def _digest_block(
    digest: Callable[[bytes], bytes],
    parent: BlockHash,
    token_ids: Sequence[int],
    extra_bytes: bytes,
) -> BlockHash:
    packed = _pack_tokens(token_ids, prefix=(len(token_ids),))
    return digest(_BLOCK_TAG + parent + packed + extra_bytes)


# (parent, block tokens, is block 0) -> the block's hash, for one config and extra keys.
ChainFn = Callable[[BlockHash, Sequence[int], bool], BlockHash]


def _chain_fn(config: HashConfig, extra: BlockExtra) -> ChainFn:
    if config.is_vllm:
        if extra.lora_id is not None:
            raise ValueError("vLLM's block hash names a LoRA by name; lora_id is not supported "
                             "with it")
        salt = extra.cache_salt

        def vllm_chain(parent: BlockHash, tokens: Sequence[int], first: bool) -> BlockHash:
            _pack_tokens(tokens)  # the same token checks as the own scheme
            return vllm_block_hash(parent, tokens, salt, first)

        return vllm_chain
    digest, extra_bytes = _digest_fn(config.algorithm), _encode_extra(extra)
    return lambda parent, tokens, first: _digest_block(digest, parent, tokens, extra_bytes)


@functools.cache
def root_hash(config: HashConfig = DEFAULT_HASH_CONFIG) -> BlockHash:
    """The hash of the root seed: the parent of block 0."""
    if config.is_vllm:
        return vllm_root_hash(config.root_seed)
    return _digest_fn(config.algorithm)(_ROOT_TAG + config.root_seed.encode("utf-8"))


def hash_block(
    parent: BlockHash,
    token_ids: Sequence[int],
    extra: BlockExtra = NO_EXTRA,
    config: HashConfig = DEFAULT_HASH_CONFIG,
) -> BlockHash:
    """Hash one block chained onto ``parent`` (``root_hash(config)`` for block 0)."""
    if len(parent) != config.digest_size:
        raise ValueError(
            f"parent hash has {len(parent)} bytes, {config.algorithm} digests have "
            f"{config.digest_size}"
        )
    return _chain_fn(config, extra)(parent, token_ids, parent == root_hash(config))


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra: BlockExtra = NO_EXTRA,
    config: HashConfig = DEFAULT_HASH_CONFIG,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``; a trailing partial block gets none."""
    _check_block_size(block_size)
    chain = _chain_fn(config, extra)
    parent = root_hash(config)
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size * block_size
    for start in range(0, num_full, block_size):
        parent = chain(parent, token_ids[start:start + block_size], start == 0)
        hashes.append(parent)
    _pack_tokens(token_ids[num_full:])  # the partial block must be valid too
    return hashes


class BlockHasher:
    """Hashes a growing token sequence (a prompt, then generated tokens) block by block.

    ``extend`` costs O(k) for k new tokens: it keeps only the tokens of the pending partial
    block and the last full-block hash. For any split of a sequence into ``extend`` calls the
    hashes equal ``hash_block_tokens`` of the whole sequence. A failed ``extend`` (bad token
    id) leaves the hasher unchanged.
    """

    __slots__ = (
        "_block_size",
        "_chain_block",
        "_hashes",
        "_num_tokens",
        "_parent",
        "_pending",
        "_root",
    )

    def __init__(
        self,
        block_size: int,
        extra: BlockExtra = NO_EXTRA,
        config: HashConfig = DEFAULT_HASH_CONFIG,
    ) -> None:
        _check_block_size(block_size)
        self._block_size = block_size
        self._chain_block = _chain_fn(config, extra)
        self._pending: list[int] = []
        self._hashes: list[BlockHash] = []
        self._num_tokens = 0
        self._root = root_hash(config)
        self._parent = self._root

    @property
    def block_hashes(self) -> list[BlockHash]:
        """All full-block hashes so far. The internal list, not a copy: do not mutate it."""
        return self._hashes

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def extend(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Append tokens; return the hashes of the blocks these tokens completed."""
        # Validate first: nothing below can fail, so a bad token leaves the hasher unchanged.
        _pack_tokens(token_ids)
        size = self._block_size
        pending = self._pending
        start = min(size - len(pending), len(token_ids))
        pending.extend(token_ids[:start])
        new_hashes: list[BlockHash] = []
        if len(pending) == size:
            new_hashes.append(self._chain(pending))
            pending.clear()
        while start + size <= len(token_ids):
            new_hashes.append(self._chain(token_ids[start:start + size]))
            start += size
        pending.extend(token_ids[start:])
        self._hashes.extend(new_hashes)
        self._num_tokens += len(token_ids)
        return new_hashes

    def _chain(self, block: Sequence[int]) -> BlockHash:
        # Only block 0 chains onto the root (`_hashes` grows after the whole `extend`).
        self._parent = self._chain_block(self._parent, block, self._parent is self._root)
        return self._parent
