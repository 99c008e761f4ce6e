"""`KVRegion`: an engine's KV cache as the transfer engine sees it (torch-free): where each
block's bytes lie, what to register, and how its blocks split into KV heads. Re-exported by
core/kv_connector.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVRegion:
    """An engine's KV cache as the transfer engine sees it: `num_blocks` blocks, each made of
    one run of `block_nbytes` bytes in every segment. Block b of segment s starts at
    `base_addr + segment_offsets[s] + b * block_stride`.

    The own engine's cache is one segment whose blocks are packed back to back (a block is
    one contiguous range across all layers: `block_stride == block_nbytes`). vLLM's is one
    segment per layer (each layer a tensor of its own), so a run of consecutive blocks is one
    descriptor per layer. `nbytes` is what the single-segment form registers; multi-segment
    layouts register `memory_ranges()`.

    A host KV tier (one segment only) adds `num_host_blocks` blocks of the same layout at
    `host_addr`, registered too, so a peer's pull can be served from host memory: block ids
    `num_blocks + s` name host slot s (only a holder's own writes use them; blocks received
    always land on the device).

    `num_kv_heads`: the model's KV heads (MLA: 1, its latent), which a block holds in every
    segment as equal byte runs, KV head outermost (this rank's share of them with tensor
    parallelism, core.kv_ranks.rank_heads): what lets a transfer between groups that split
    the heads differently address a range of heads (the own engine's one segment; vLLM's CPU
    layout, one segment per layer). 0: not head-addressable (vLLM's GPU layouts, token
    outermost), only same-layout moves."""

    base_addr: int
    nbytes: int
    block_nbytes: int
    num_blocks: int
    block_stride: int = 0  # 0: block_nbytes (blocks back to back)
    segment_offsets: tuple[int, ...] = (0,)
    host_addr: int = 0
    num_host_blocks: int = 0
    num_kv_heads: int = 0

    def __post_init__(self) -> None:
        if self.block_nbytes <= 0 or self.num_blocks < 0:
            raise ValueError("a KVRegion needs block_nbytes > 0 and num_blocks >= 0")
        if self.block_stride and self.block_stride < self.block_nbytes:
            raise ValueError(f"block_stride {self.block_stride} < block_nbytes "
                             f"{self.block_nbytes}: blocks would overlap")
        if not self.segment_offsets or self.segment_offsets[0] != 0:
            raise ValueError("segment_offsets must start with 0 (segment 0 is the base)")
        if self.num_host_blocks < 0 or (self.num_host_blocks and self.num_segments != 1):
            raise ValueError("a host tier needs num_host_blocks >= 0 and one segment")
        if self.num_kv_heads < 0:
            raise ValueError("num_kv_heads must be >= 0")

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_nbytes

    @property
    def num_segments(self) -> int:
        return len(self.segment_offsets)

    def block_addr(self, block_id: int) -> int:
        """Where block `block_id` starts in segment 0 (add a segment's offset for the others);
        ids past the device's blocks are host slots."""
        if 0 <= block_id < self.num_blocks:
            return self.base_addr + block_id * self.stride
        slot = block_id - self.num_blocks
        if 0 <= slot < self.num_host_blocks:
            return self.host_addr + slot * self.stride
        raise ValueError(f"block id {block_id} outside [0, "
                         f"{self.num_blocks + self.num_host_blocks})")

    def memory_ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) ranges to register with the transfer engine: the whole region
        for one packed segment, else each segment's span, merged where they touch."""
        host = [(self.host_addr, self.num_host_blocks * self.stride)] \
            if self.num_host_blocks else []
        if self.num_segments == 1 and self.stride == self.block_nbytes:
            return [(self.base_addr, self.nbytes), *host]
        span = (self.num_blocks - 1) * self.stride + self.block_nbytes if self.num_blocks else 0
        ranges = sorted((self.base_addr + off, span) for off in self.segment_offsets)
        merged: list[tuple[int, int]] = []
        for addr, nbytes in ranges:
            if merged and addr <= merged[-1][0] + merged[-1][1]:
                start, length = merged[-1]
                merged[-1] = (start, max(length, addr + nbytes - start))
            else:
                merged.append((addr, nbytes))
        return merged + host
