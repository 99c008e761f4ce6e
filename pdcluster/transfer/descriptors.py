"""Transfer descriptors: turning per-block address lists into as few (src, dst, length)
descriptors as the KV layout allows."""

from __future__ import annotations

from collections.abc import Sequence


def coalesce(src_addrs: Sequence[int], dst_addrs: Sequence[int],
             length_each: int) -> tuple[list[int], list[int], list[int]]:
    """Merge descriptors of `length_each` bytes into maximal runs that are contiguous in BOTH
    source and destination, so n consecutive KV blocks travel as one descriptor. Order is
    kept; the byte mapping src -> dst is exactly that of the input."""
    if len(src_addrs) != len(dst_addrs):
        raise ValueError(f"{len(src_addrs)} source and {len(dst_addrs)} destination addresses")
    if length_each <= 0:
        raise ValueError(f"length_each must be positive, got {length_each}")
    srcs: list[int] = []
    dsts: list[int] = []
    lengths: list[int] = []
    for src, dst in zip(src_addrs, dst_addrs, strict=True):
        if lengths and src == srcs[-1] + lengths[-1] and dst == dsts[-1] + lengths[-1]:
            lengths[-1] += length_each
        else:
            srcs.append(src)
            dsts.append(dst)
            lengths.append(length_each)
    return srcs, dsts, lengths
