"""vLLM's prefix-cache block hash, computed without vLLM: so that a router (and the metadata
service) can name the blocks a vLLM node caches from the prompt's tokens alone.

vLLM (`vllm.v1.core.kv_cache_utils`, algorithm `sha256_cbor`) chains full blocks as

    h_root = SHA-256(CBOR(seed))                  seed: $PYTHONHASHSEED, else "vllm-none-hash"
    h_i    = SHA-256(CBOR((h_{i-1}, tokens_i, extra_i)))

with canonical CBOR, tokens as an array of ints and `extra_i` None, except for block 0 of a
salted request: `(("cache_salt", salt),)`. Its default algorithm, `sha256`, pickles the tuple
instead, which only Python with the same pickle protocol reproduces: nodes that run vLLM are
configured with `sha256_cbor` (`pdcluster.vllm_backend`), never the default.

API: `VLLM_HASH_ALGORITHM`, `VLLM_DEFAULT_SEED`, `vllm_root_hash`, `vllm_block_hash`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import cbor2

VLLM_HASH_ALGORITHM = "vllm_sha256_cbor"
VLLM_DEFAULT_SEED = "vllm-none-hash"


@functools.cache
def vllm_root_hash(seed: str) -> bytes:
    """vLLM's NONE_HASH for `seed`: the parent of block 0."""
    return hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()


def vllm_block_hash(parent: bytes, token_ids: Sequence[int], cache_salt: str | None,
                    first_block: bool) -> bytes:
    """One block chained onto `parent`; the salt enters block 0 only (chaining carries it)."""
    extra = (("cache_salt", cache_salt),) if first_block and cache_salt else None
    payload = cbor2.dumps((parent, tuple(token_ids), extra), canonical=True)
    return hashlib.sha256(payload).digest()
