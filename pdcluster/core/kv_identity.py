"""A node's KV identity: what two processes must share for a block hash computed in one to name
the same KV in the other — the block size, the hash function and its root seed
(`core.hashing.HashConfig`), the model, and the tokenizer that turned text into the token ids.

Nodes register theirs with the metadata service (`NodeInfo`); the router takes the cluster's
from there and routes only to nodes whose identity equals it (`router.routing.identity`). A
router hashing prompts with another block size or seed names blocks no node holds: every
prefix lookup a silent miss.

The tokenizer is named by `tokenizer_digest(model_dir)`: SHA-256 of the bytes of the model
folder's `tokenizer.json`, not a digest of its vocabulary, because

- it is the file the router maps text to ids with (`router.api.tokenizer`), so equal bytes
  give equal token ids in every process;
- it needs no tokenizer library and no library version enters it: the router, the own engine
  and a vLLM node compute it alike, in milliseconds, while a digest of a parsed vocabulary
  depends on the installed `tokenizers`, which the router's pod and the nodes' image need not
  share;
- a vocabulary alone misses the merges, the normalizer and the pre-tokenizer, which change the
  ids of the same text: a silent false match, the very failure this identity is for. Its own
  failure is the opposite, visible one: an equivalent file saved differently reads as a
  mismatch, both digests shown in the router's /health (mount the same files).

A folder without `tokenizer.json` declares none (""), which matches no router's.

API: `KVIdentity`, `IDENTITY_FIELDS`, `tokenizer_digest`, `model_name`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from pdcluster.core.hashing import HashConfig

IDENTITY_FIELDS = ("block_size", "hash_algorithm", "hash_seed", "model", "tokenizer_digest")
TOKENIZER_FILE = "tokenizer.json"
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class KVIdentity:
    """One node's identity as registered (or the cluster's). A record, not a config: a
    registration may carry anything, so nothing is checked at construction; `problems` says
    why one cannot be routed with."""

    block_size: int
    hash_algorithm: str
    hash_seed: str
    model: str = ""  # the model's name: its folder's name (`model_name`)
    tokenizer_digest: str = ""

    @classmethod
    def of(cls, block_size: int, hash_config: HashConfig, model_dir: str | Path) -> KVIdentity:
        """The identity of an engine serving the model folder `model_dir`."""
        return cls(block_size, hash_config.algorithm, hash_config.root_seed,
                   model_name(model_dir), tokenizer_digest(model_dir))

    @property
    def hash_config(self) -> HashConfig:
        """ValueError for an algorithm this process does not know (see `problems`)."""
        return HashConfig(self.hash_algorithm, self.hash_seed)

    def problems(self) -> dict[str, str]:
        """Why prompts cannot be hashed with this identity, by field; empty: they can."""
        found: dict[str, str] = {}
        if self.block_size < 1:
            found["block_size"] = f"block_size {self.block_size} (must be >= 1)"
        try:
            HashConfig(self.hash_algorithm)
        except ValueError as exc:
            found["hash_algorithm"] = str(exc)
        if not self.hash_seed:
            found["hash_seed"] = "hash_seed is empty"
        return found

    def mismatches(self, other: KVIdentity) -> list[str]:
        """The fields (`IDENTITY_FIELDS`) in which `other` differs from this identity."""
        return [name for name in IDENTITY_FIELDS if getattr(self, name) != getattr(other, name)]

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in IDENTITY_FIELDS}


def model_name(model_dir: str | Path) -> str:
    """The name a model goes by: its folder's name (the router's default served name)."""
    return Path(str(model_dir).rstrip("/")).name


def tokenizer_digest(model_dir: str | Path) -> str:
    """"sha256:<hex>" of the folder's tokenizer.json (module docstring); "" without one."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        return ""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"
