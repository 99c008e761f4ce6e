"""Tests of the cluster-wide block hash: determinism, chaining, extra keys, incremental use."""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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

REPO_ROOT = Path(__file__).resolve().parents[2]
XXH3 = HashConfig(algorithm="xxh3_128")
token_ids_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=60)


def test_same_input_same_hashes() -> None:
    tokens = list(range(100, 140))
    first = hash_block_tokens(tokens, 8)
    assert first == hash_block_tokens(list(tokens), 8)
    assert first == hash_block_tokens(tuple(tokens), 8)
    assert len(first) == 5
    assert len(set(first)) == 5


def test_encoding_is_little_endian_and_fixed() -> None:
    # Rebuild the documented encoding independently; guards against native byte order.
    seed = DEFAULT_HASH_CONFIG.root_seed.encode()
    root = hashlib.sha256(b"\x10" + seed).digest()
    tokens = [1, 2, 3, 0xABCDEF01]
    block = b"\x11" + root + struct.pack("<5I", 4, *tokens) + b"\x00"
    assert root_hash() == root
    assert hash_block(root, tokens) == hashlib.sha256(block).digest()
    salted = BlockExtra(cache_salt="é", lora_id=7)
    extra = b"\x03" + struct.pack("<I", 2) + "é".encode() + struct.pack("<q", 7)
    expected = hashlib.sha256(block[:-1] + extra).digest()
    assert hash_block(root, tokens, salted) == expected


def test_golden_values() -> None:
    # Pinned digests: a change here breaks every node's cache and the global index.
    assert root_hash().hex() == (
        "fdf8ab1db1ebc1cc91224a5c9866752f9a610aed5a75c4d85e5750959f025bac")
    assert hash_block_tokens([0, 1, 2, 3], 4, config=XXH3)[0].hex() == (
        "8af68d343a0904fe4fd902ad30713e97")


def test_chaining_block_zero_changes_every_later_hash() -> None:
    tokens = list(range(32))
    changed = [999, *tokens[1:]]
    base, other = hash_block_tokens(tokens, 4), hash_block_tokens(changed, 4)
    assert all(a != b for a, b in zip(base, other, strict=True))


def test_change_in_later_block_keeps_prefix() -> None:
    tokens = list(range(32))
    changed = [*tokens[:9], 999, *tokens[10:]]
    base, other = hash_block_tokens(tokens, 4), hash_block_tokens(changed, 4)
    assert base[:2] == other[:2]
    assert all(a != b for a, b in zip(base[2:], other[2:], strict=True))


def test_chain_matches_hash_block() -> None:
    tokens = list(range(12))
    parent = root_hash()
    expected = []
    for start in range(0, 12, 4):
        parent = hash_block(parent, tokens[start:start + 4])
        expected.append(parent)
    assert hash_block_tokens(tokens, 4) == expected


def test_partial_block_gets_no_hash() -> None:
    assert hash_block_tokens(list(range(10)), 4) == hash_block_tokens(list(range(8)), 4)
    assert hash_block_tokens(list(range(3)), 4) == []
    assert hash_block_tokens([], 4) == []
    hasher = BlockHasher(4)
    assert hasher.extend(range(3)) == []
    assert hasher.block_hashes == [] and hasher.num_tokens == 3


@settings(max_examples=150, deadline=None)
@given(
    tokens=token_ids_st,
    block_size=st.integers(min_value=1, max_value=9),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=8),
    algorithm=st.sampled_from(["sha256", "xxh3_128"]),
)
def test_incremental_equals_one_shot(
    tokens: list[int], block_size: int, cuts: list[int], algorithm: str
) -> None:
    config = HashConfig(algorithm=algorithm)
    extra = BlockExtra(cache_salt="tenant", lora_id=3)
    hasher = BlockHasher(block_size, extra, config)
    bounds = [0, *sorted(min(c, len(tokens)) for c in cuts), len(tokens)]
    collected = []
    for lo, hi in itertools.pairwise(bounds):
        collected.extend(hasher.extend(tokens[lo:hi]))
    expected = hash_block_tokens(tokens, block_size, extra, config)
    assert collected == expected
    assert hasher.block_hashes == expected
    assert hasher.num_tokens == len(tokens)


def test_extra_keys_separate_hashes() -> None:
    extras = [
        NO_EXTRA,
        BlockExtra(cache_salt=""),
        BlockExtra(cache_salt="a"),
        BlockExtra(cache_salt="b"),
        BlockExtra(lora_id=0),
        BlockExtra(lora_id=1),
        BlockExtra(cache_salt="a", lora_id=1),
    ]
    hashes = [hash_block(root_hash(), [5, 6, 7], extra) for extra in extras]
    assert len(set(hashes)) == len(extras)


def test_root_seed_and_algorithm_separate_hashes() -> None:
    configs = [DEFAULT_HASH_CONFIG, HashConfig(root_seed="other"), XXH3,
               HashConfig(algorithm="xxh3_128", root_seed="other")]
    roots = {root_hash(config) for config in configs}
    blocks = {hash_block_tokens([1, 2], 2, config=config)[0] for config in configs}
    assert len(roots) == len(blocks) == len(configs)


def test_digest_lengths() -> None:
    assert len(root_hash()) == 32
    assert len(hash_block_tokens([1, 2], 2)[0]) == 32
    assert len(root_hash(XXH3)) == 16
    assert len(hash_block_tokens([1, 2], 2, config=XXH3)[0]) == 16
    assert XXH3.digest_size == 16 and DEFAULT_HASH_CONFIG.digest_size == 32


@pytest.mark.parametrize("kwargs", [{"algorithm": "md5"}, {"root_seed": ""}])
def test_invalid_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        HashConfig(**kwargs)


@pytest.mark.parametrize("lora_id", [-1, 2**63])
def test_invalid_lora_id(lora_id: int) -> None:
    with pytest.raises(ValueError):
        BlockExtra(lora_id=lora_id)


@pytest.mark.parametrize("bad", [[-1], [2**32], [1, 2, 2**40], [1.5]])
def test_invalid_token_ids(bad: list) -> None:
    with pytest.raises(ValueError):
        hash_block(root_hash(), bad)
    with pytest.raises(ValueError):
        hash_block_tokens([0] * 3 + bad, 1)
    with pytest.raises(ValueError):
        BlockHasher(2).extend(bad)


def test_token_id_bounds_accepted() -> None:
    assert len(hash_block(root_hash(), [0, 2**32 - 1])) == 32


def test_failed_extend_leaves_hasher_unchanged() -> None:
    hasher = BlockHasher(2)
    hasher.extend([1, 2, 3])
    before = list(hasher.block_hashes)
    with pytest.raises(ValueError):
        hasher.extend([4, 5, -1])
    assert hasher.block_hashes == before and hasher.num_tokens == 3
    assert hasher.extend([4]) == hash_block_tokens([1, 2, 3, 4], 2)[1:]


def test_invalid_block_size_and_parent() -> None:
    with pytest.raises(ValueError):
        hash_block_tokens([1, 2], 0)
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(ValueError, match="parent"):
        hash_block(root_hash(XXH3), [1])  # 16-byte parent with the SHA-256 config


_CHILD = """
from pdcluster.core.hashing import BlockExtra, HashConfig, hash_block_tokens
extra = BlockExtra(cache_salt="tenant-7", lora_id=2)
for algorithm in ("sha256", "xxh3_128"):
    config = HashConfig(algorithm=algorithm)
    print(",".join(h.hex() for h in hash_block_tokens(list(range(50)), 16, extra, config)))
"""


def _child_hashes(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def test_identical_hashes_across_processes() -> None:
    first, second = _child_hashes("0"), _child_hashes("4242")
    extra = BlockExtra(cache_salt="tenant-7", lora_id=2)
    here = "".join(
        ",".join(h.hex() for h in hash_block_tokens(list(range(50)), 16, extra, config)) + "\n"
        for config in (DEFAULT_HASH_CONFIG, XXH3))
    assert first == second == here
    assert len(first.splitlines()) == 2
