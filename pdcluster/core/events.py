"""KV cache events: what a node's block pool reports so the global block index stays exact.

A node records these as blocks enter, move between and leave its cache tiers and publishes
them (with per-node sequence numbers, added by the publisher) to the metadata service.

Media (tiers): a block's copies live on the device (`DEVICE`: GPU memory, or the engine's KV
region on CPU), in host memory (`HOST`) or on local disk (`DISK`); a node holds a block
while it has a copy on any of them. As in vLLM's events, `BlockStored` and `BlockRemoved`
name the medium whose copy appeared or went (`BlockRemoved` with no medium: every copy), and
a block demoted from the device to the host (or loaded back) is one `BlockMoved`, so the
index never sees it leave in between.

API: ``DEVICE``, ``HOST``, ``DISK``, ``MEDIA``, ``check_medium``, ``BlockStored``,
``BlockRemoved``, ``BlockMoved``, ``AllBlocksCleared`` and the union ``KVEvent``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.core.types import BlockHash

DEVICE = "device"
HOST = "host"
DISK = "disk"
MEDIA = (DEVICE, HOST, DISK)  # fastest first


def check_medium(medium: str) -> str:
    if medium not in MEDIA:
        raise ValueError(f"medium must be one of {MEDIA}, got {medium!r}")
    return medium


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A contiguous chain of blocks got a copy on ``medium``.

    ``block_hashes[0]``'s parent is ``parent_hash`` (None: the chain starts at the root), and
    each later hash's parent is the one before it.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    block_size: int
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These blocks lost their copy on ``medium`` (None: every copy; the node no longer holds
    them)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockMoved:
    """These blocks' copy on ``src`` went and one on ``dst`` appeared, in one step (a device
    block demoted to the host, a host block loaded back to the device)."""

    block_hashes: tuple[BlockHash, ...]
    src: str
    dst: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The node dropped its whole prefix cache (every tier)."""


KVEvent = BlockStored | BlockRemoved | BlockMoved | AllBlocksCleared
