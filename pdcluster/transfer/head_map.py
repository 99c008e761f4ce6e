"""Mapping KV head ranges between two tensor-parallel groups (pure, torch-free).

Each rank of a group holds the same block ids, each block its own KV heads, KV head outermost
(engine/kv/kv_cache.py), so a range of heads of a block is one byte range. `head_moves` says,
for a source group of `src_tp` ranks and a destination group of `dst_tp`, which source rank
sends which of its local heads to which destination rank:

- every destination rank gets every head it holds exactly once (each destination byte is
  written once); consecutive heads from one source rank are one move;
- a head the source replicates (fewer KV heads than source ranks; MLA's latent, held by every
  rank) comes from one of its holders, picked by the destination rank's index so that the
  holders share the sending;
- a head the destination replicates goes to every destination rank that holds it (its own
  copy each: MLA's latent moves one copy per destination rank).

`plan_writes` turns the moves into descriptors for a list of blocks: one per (source rank,
destination rank, block) overlap, and where a move covers whole blocks on both sides (the
same split: same TP, or one rank to one rank) consecutive blocks merge into one descriptor as
before. The result is grouped per source rank and destination session: what each source rank
writes, in one batch per peer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.core.kv_ranks import rank_heads
from pdcluster.transfer.descriptors import coalesce


@dataclass(frozen=True, slots=True)
class HeadMove:
    """Source rank `src_rank`'s local heads `[src_head, src_head + num_heads)` go to
    destination rank `dst_rank`'s local heads from `dst_head`."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One side of a transfer: the model's KV heads, bytes of one block on one rank, and per
    rank its transfer-engine session and region base (rank 0 first)."""

    num_kv_heads: int
    block_nbytes: int
    sessions: tuple[str, ...]
    bases: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sessions or len(self.sessions) != len(self.bases):
            raise ValueError("a group layout needs one base address per session")
        if self.block_nbytes % len(rank_heads(self.num_kv_heads, self.tp_size, 0)):
            raise ValueError(f"block of {self.block_nbytes} bytes does not split into its "
                             "heads")

    @property
    def tp_size(self) -> int:
        return len(self.sessions)

    @property
    def head_nbytes(self) -> int:
        """Bytes of one KV head of one block (every layer and plane)."""
        return self.block_nbytes // len(rank_heads(self.num_kv_heads, self.tp_size, 0))


@dataclass(frozen=True, slots=True)
class RankWrite:
    """What source rank `rank` writes into destination `session`."""

    rank: int
    session: str
    src: list[int]
    dst: list[int]
    lengths: list[int]


def head_moves(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadMove]:
    """The moves from a group of `src_tp` ranks to one of `dst_tp` (see the module doc)."""
    moves: list[HeadMove] = []
    for dst_rank in range(dst_tp):
        wanted = rank_heads(num_kv_heads, dst_tp, dst_rank)
        for head in wanted:
            holders = [r for r in range(src_tp) if head in rank_heads(num_kv_heads, src_tp, r)]
            src_rank = holders[dst_rank % len(holders)]
            src_head = head - rank_heads(num_kv_heads, src_tp, src_rank).start
            last = moves[-1] if moves else None
            if (last is not None and last.dst_rank == dst_rank and last.src_rank == src_rank
                    and last.src_head + last.num_heads == src_head):
                moves[-1] = HeadMove(src_rank, dst_rank, last.src_head, last.dst_head,
                                     last.num_heads + 1)
            else:
                moves.append(HeadMove(src_rank, dst_rank, src_head, head - wanted.start, 1))
    return moves


def plan_writes(src: GroupLayout, dst: GroupLayout, src_offsets: list[int],
                dst_offsets: list[int]) -> list[RankWrite]:
    """Descriptors moving blocks at `src_offsets` (bytes from each source rank's base) to
    `dst_offsets` (from each destination rank's base), same order; ValueError when the two
    layouts are not of one model, dtype and block size."""
    if src.num_kv_heads != dst.num_kv_heads or src.head_nbytes != dst.head_nbytes:
        raise ValueError(
            f"KV layout mismatch: {dst.num_kv_heads} KV heads of {dst.head_nbytes} bytes a "
            f"block asked, {src.num_kv_heads} of {src.head_nbytes} held (same model, dtype "
            "and block size on both nodes?)")
    if len(src_offsets) != len(dst_offsets):
        raise ValueError(f"{len(src_offsets)} source and {len(dst_offsets)} destination blocks")
    head_nbytes = src.head_nbytes
    writes: dict[tuple[int, int], RankWrite] = {}
    for move in head_moves(src.num_kv_heads, src.tp_size, dst.tp_size):
        src_start = src.bases[move.src_rank] + move.src_head * head_nbytes
        dst_start = dst.bases[move.dst_rank] + move.dst_head * head_nbytes
        s, d, n = coalesce([src_start + off for off in src_offsets],
                           [dst_start + off for off in dst_offsets],
                           move.num_heads * head_nbytes)
        key = (move.src_rank, move.dst_rank)
        if key not in writes:
            writes[key] = RankWrite(move.src_rank, dst.sessions[move.dst_rank], [], [], [])
        write = writes[key]
        write.src.extend(s)
        write.dst.extend(d)
        write.lengths.extend(n)
    return [w for w in writes.values() if w.src]
