"""Writing this node's blocks into a peer's: `GroupWriter`, the data-plane half of the
connector worker, for P's sends and a holder's served pulls alike.

A node is a tensor-parallel group of one rank or more (core.kv_ranks): rank 0 here, with the
transport, and ranks 1..N-1 in their own processes, each with its own transfer engine and
region. A peer's request names its own group (`dest_group`: the model's KV heads, each rank's
session and region base). Rank 0 plans every rank's share (transfer/head_map.py: each
destination byte written once, from one source rank), writes its own, has the other ranks
write theirs (`KVRanks.write`, concurrently), and the transfer is done when every rank is;
one rank's failure (or death) fails it, and the requester recomputes.

A layout of several segments (vLLM's cache, one per layer, each block KV head outermost)
is mapped segment by segment: segment s of every source rank into segment s of every
destination rank, each rank's segments at its own offsets (`KVGroup.segment_offsets`).
Layouts without addressable heads (`KVRegion.num_kv_heads == 0`) keep the
one-rank, same-layout path: both sides must have as many segments of the same block size, and
consecutive blocks coalesce within each segment.

`destination(msg)` is what a write needs of an `XferRequest` or `PrefixPullRequest`.
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from pdcluster.core.kv_connector import KVRegion
from pdcluster.core.kv_ranks import KVRanks
from pdcluster.core.kv_transfer import KVGroup, PrefixPullRequest, XferRequest
from pdcluster.transfer.descriptors import coalesce
from pdcluster.transfer.errors import TransferError
from pdcluster.transfer.head_map import GroupLayout, RankWrite, plan_writes
from pdcluster.transfer.transport import Transport


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a write goes: the requester's rank-0 session, block size and segment offsets,
    and its group (None: a layout without addressable heads)."""

    session: str
    block_nbytes: int
    segment_offsets: list[int]
    group: KVGroup | None


def destination(msg: XferRequest | PrefixPullRequest) -> Destination:
    return Destination(msg.dest_session, msg.block_nbytes, msg.dest_segment_offsets,
                       msg.dest_group)


class GroupWriter:
    def __init__(self, transport: Transport, region: KVRegion, ranks: KVRanks | None,
                 timeout_s: float) -> None:
        if ranks is not None and not region.num_kv_heads:
            raise ValueError("tensor-parallel ranks need a head-addressable KV region "
                             "(num_kv_heads)")
        self.transport, self.region, self.ranks = transport, region, ranks
        self.timeout_s = timeout_s
        endpoints = ranks.endpoints if ranks is not None else []
        # each rank's segment offsets from its base, rank 0 first
        self._segments = [list(region.segment_offsets),
                          *(list(e.segment_offsets) for e in endpoints)]
        if any(len(offsets) != region.num_segments for offsets in self._segments):
            raise ValueError("every tensor-parallel rank needs as many KV segments as rank 0")
        sessions = (transport.session_id, *(e.session for e in endpoints))
        self._layout = GroupLayout(
            region.num_kv_heads, region.block_nbytes, sessions,
            (region.base_addr, *(e.base_addr for e in endpoints))) \
            if region.num_kv_heads else None
        # each rank's host tier, slot for slot rank 0's: a holder's pull served from there
        self._host_layout = GroupLayout(
            region.num_kv_heads, region.block_nbytes, sessions,
            (region.host_addr, *(e.host_addr for e in endpoints))) \
            if region.num_kv_heads and region.num_host_blocks and ranks is not None else None

    @property
    def group(self) -> KVGroup | None:
        """This node's group, for the requests it sends (None: no addressable heads)."""
        layout = self._layout
        if layout is None:
            return None
        segments = self._segments if self.region.num_segments > 1 else []
        return KVGroup(layout.num_kv_heads, list(layout.sessions), list(layout.bases),
                       segments)

    def write(self, block_ids: list[int], dest_addrs: list[int],
              dest: Destination) -> tuple[int, int]:
        """Write local blocks to the requester's blocks at `dest_addrs` (its rank 0's
        addresses): (descriptors, bytes) written by every rank together."""
        if self._layout is None or (dest.group is None and self.ranks is None):
            return self._write_segments(block_ids, dest_addrs, dest)
        dst_layout, dst_segments = self._dest_layout(dest), self._dest_segments(dest)
        dst_offsets = self._dest_offsets(dest_addrs, dest.group)
        writes: list[RankWrite] = []
        for layout, picked in self._by_tier(block_ids):  # a host tier has one segment only
            src_offsets = [self._offset(block_ids[i]) for i in picked]
            picked_dst = [dst_offsets[i] for i in picked]
            writes += _per_peer([
                w for s in range(self.region.num_segments)
                for w in plan_writes(_shifted(layout, [o[s] for o in self._segments]),
                                     _shifted(dst_layout, [o[s] for o in dst_segments]),
                                     src_offsets, picked_dst)])
        self._run(writes)
        return sum(len(w.src) for w in writes), sum(sum(w.lengths) for w in writes)

    def _dest_segments(self, dest: Destination) -> list[list[int]]:
        """Each destination rank's segment offsets, as many as this node's segments."""
        group = dest.group
        segments = [group.rank_segments(r) for r in range(group.tp_size)] \
            if group is not None else [[0]]
        if len(segments[0]) != self.region.num_segments:
            raise ValueError(
                f"KV layout mismatch: {len(segments[0])} segments asked, "
                f"{self.region.num_segments} held (same model and engine on both nodes?)")
        return segments

    def _dest_layout(self, dest: Destination) -> GroupLayout:
        group = dest.group
        if group is None:  # a one-rank peer of a plain layout: its addresses are absolute
            if len(dest.segment_offsets) != 1:
                raise ValueError("KV layout mismatch: a tensor-parallel group cannot write "
                                 f"into a layout of {len(dest.segment_offsets)} segments")
            assert self._layout is not None, "checked by write()"
            return GroupLayout(self._layout.num_kv_heads, dest.block_nbytes, (dest.session,),
                               (0,))
        return GroupLayout(group.num_kv_heads, dest.block_nbytes, tuple(group.sessions),
                           tuple(group.bases))

    def _by_tier(self, block_ids: list[int]) -> list[tuple[GroupLayout, list[int]]]:
        """The indices of `block_ids` each source layout writes: one rank's region holds its
        host slots too (at offsets from its base); several ranks' host tiers lie apart from
        their device regions, each at its own address (`_host_layout`)."""
        assert self._layout is not None, "checked by write()"
        num_device = self.region.num_blocks
        on_host = [i for i, b in enumerate(block_ids) if b >= num_device]
        if not on_host or self._host_layout is None:
            if on_host and self.ranks is not None:
                raise ValueError("host-tier blocks named, but the ranks registered no host tier")
            return [(self._layout, list(range(len(block_ids))))]
        on_device = [i for i, b in enumerate(block_ids) if b < num_device]
        return [(self._layout, on_device), (self._host_layout, on_host)]

    def _offset(self, block_id: int) -> int:
        """Bytes from the base of the layout that holds `block_id` (`_by_tier`)."""
        region = self.region
        if self._host_layout is not None and block_id >= region.num_blocks:
            return region.block_addr(block_id) - region.host_addr
        return region.block_addr(block_id) - region.base_addr

    @staticmethod
    def _dest_offsets(dest_addrs: list[int], group: KVGroup | None) -> list[int]:
        base = group.bases[0] if group is not None else 0
        return [a - base for a in dest_addrs]

    def _run(self, writes: list[RankWrite]) -> None:
        """Every rank's writes, the other ranks' concurrently with rank 0's; raises
        TransferError naming the ranks that failed once all have finished."""
        futures: list[tuple[int, Future[None]]] = []
        for w in writes:
            if w.rank:
                assert self.ranks is not None, "a plan names other ranks only when there are"
                futures.append((w.rank, self.ranks.write(w.rank, w.session, w.src, w.dst,
                                                         w.lengths)))
        errors: list[str] = []
        for w in writes:
            if not w.rank:
                try:
                    self.transport.write(w.session, w.src, w.dst, w.lengths)
                except Exception as exc:  # the others still finish before this one reports
                    errors.append(f"rank 0: {exc}")
        for rank, future in futures:
            try:
                future.result(timeout=self.timeout_s)
            except FutureTimeout:
                errors.append(f"rank {rank}: no answer within {self.timeout_s:g} s")
            except Exception as exc:
                errors.append(f"rank {rank}: {exc}")
        if errors:
            raise TransferError("; ".join(errors))

    def _write_segments(self, block_ids: list[int], dest_addrs: list[int],
                        dest: Destination) -> tuple[int, int]:
        """The same-layout path (one rank each side), every segment of the layout."""
        region = self.region
        if dest.block_nbytes != region.block_nbytes \
                or len(dest.segment_offsets) != region.num_segments:
            raise ValueError(
                f"KV layout mismatch: {len(dest.segment_offsets)} segments of "
                f"{dest.block_nbytes} bytes asked, {region.num_segments} of "
                f"{region.block_nbytes} held (same model, dtype, block size and engine on "
                "both nodes?)")
        local = [region.block_addr(b) for b in block_ids]
        src: list[int] = []
        dst: list[int] = []
        lengths: list[int] = []
        for src_offset, dst_offset in zip(region.segment_offsets, dest.segment_offsets,
                                          strict=True):
            s, d, n = coalesce([a + src_offset for a in local],
                               [a + dst_offset for a in dest_addrs], region.block_nbytes)
            src += s
            dst += d
            lengths += n
        if src:
            self.transport.write(dest.session, src, dst, lengths)
        return len(src), sum(lengths)


def _shifted(layout: GroupLayout, offsets: list[int]) -> GroupLayout:
    """`layout` with every rank's base moved by that rank's offset (one segment's bases)."""
    return GroupLayout(layout.num_kv_heads, layout.block_nbytes, layout.sessions,
                       tuple(b + o for b, o in zip(layout.bases, offsets, strict=True)))


def _per_peer(writes: list[RankWrite]) -> list[RankWrite]:
    """The writes of every segment joined per (source rank, destination session): one batch
    each."""
    joined: dict[tuple[int, str], RankWrite] = {}
    for w in writes:
        into = joined.setdefault((w.rank, w.session), RankWrite(w.rank, w.session, [], [], []))
        into.src.extend(w.src)
        into.dst.extend(w.dst)
        into.lengths.extend(w.lengths)
    return list(joined.values())
