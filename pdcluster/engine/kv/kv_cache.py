"""The paged KV cache tensor and its byte layout.

Layout: one tensor `[num_blocks, num_kv_heads, num_layers, num_planes, block_size, head_dim]`:
two planes (keys, values) for attention with KV heads; one plane for Multi-head Latent
Attention, whose entry per token is the compressed latent and the shared RoPE key
(`num_kv_heads=1`, `head_dim=kv_lora_rank + qk_rope_head_dim`). Block b of every layer, all
planes, is the single contiguous byte range
`[b * block_nbytes, (b + 1) * block_nbytes)` of one region, and n consecutive blocks are one
range: a transfer of a request's blocks is a handful of large descriptors, never one per
(layer, block). KV heads are the outermost dimension inside a block, so a range of heads of a
block is one byte range too (`head_range`): between nodes whose tensor-parallel ranks split the
heads differently, one rank's part of a block moves as one descriptor. Per-layer views
(`layer_kv(l)`) are strided views `[num_blocks, block_size, num_kv_heads, head_dim]` into that
region, which is what attention writes and reads through block tables (a block's keys of one
head and layer are contiguous: one read per tile of keys).

`KVCacheSpec` (torch-free sizes) lets the connector and the scheduler reason about bytes
without touching torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_nbytes: int
    num_planes: int = 2  # keys and values; 1 for MLA's latent

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers and planes."""
        return (
            self.num_layers * self.num_planes * self.block_size * self.num_kv_heads * self.head_dim
        ) * self.dtype_nbytes

    @property
    def total_nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def block_range(self, block_id: int, num_blocks: int = 1) -> tuple[int, int]:
        """(offset, length) in bytes of `num_blocks` consecutive blocks from `block_id`."""
        return block_id * self.block_nbytes, num_blocks * self.block_nbytes

    def head_range(self, block_id: int, first_head: int, num_heads: int) -> tuple[int, int]:
        """(offset, length) in bytes of heads `[first_head, first_head + num_heads)` of one
        block, every layer and plane: one contiguous range."""
        per_head = self.block_nbytes // self.num_kv_heads
        return block_id * self.block_nbytes + first_head * per_head, num_heads * per_head


class PagedKVCache:
    """Owns the KV region. Zero-filled: padding slots read during batched decode must be
    finite, since a NaN times a zero attention weight is still NaN.

    One block more than the spec's is allocated after the region: the scratch block, which no
    request owns and no transfer sees. A CUDA graph captured for a batch of 8 and replayed for
    5 sequences writes the 3 padding rows' keys and values there (`scratch_slot_row`)."""

    def __init__(self, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        shape = (spec.num_blocks + 1, spec.num_kv_heads, spec.num_layers, spec.num_planes,
                 spec.block_size, spec.head_dim)
        self._allocation = torch.zeros(shape, dtype=dtype, device=device)
        self.tensor = self._allocation[: spec.num_blocks]  # the region: what blocks index

        # The region as rows of one head's keys (or values) of one token and layer. Writes go
        # through this contiguous view with index_copy_: advanced-index assignment into the
        # strided per-layer views takes milliseconds on CPU, this takes microseconds.
        self._rows = self._allocation.view(-1, spec.head_dim)
        self._head_stride = spec.num_layers * spec.num_planes * spec.block_size
        self._rows_per_block = spec.num_kv_heads * self._head_stride

    @property
    def rows_per_block(self) -> int:
        """Rows of `rows` one block spans (all heads, layers, planes and slots)."""
        return self._rows_per_block

    @property
    def head_stride(self) -> int:
        """Rows of `rows` between one KV head and the next of the same token and layer."""
        return self._head_stride

    @property
    def scratch_slot_row(self) -> int:
        """`slot_rows` entry of the scratch block's first slot (see the class doc)."""
        return self.spec.num_blocks * self._rows_per_block

    @property
    def rows(self) -> torch.Tensor:
        """The region as `[rows, head_dim]`: one head's keys (or values) of one token and
        layer a row (what `write` indexes, and the kernels' cache write)."""
        return self._rows

    def key_row_offset(self, layer: int) -> int:
        """Added to a slot's `slot_rows` entry: the row of its first KV head's keys in `layer`
        (values are `block_size` rows further, head h `h * head_stride` rows further)."""
        return 2 * layer * self.spec.block_size

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views `[num_blocks, block_size, num_kv_heads, head_dim]` for one layer."""
        return (self.tensor[:, :, layer, 0].transpose(1, 2),
                self.tensor[:, :, layer, 1].transpose(1, 2))

    def slot_rows(self, block_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Row index of each token slot's layer-0 keys of KV head 0; see `write`."""
        return block_ids * self._rows_per_block + offsets

    def write(self, layer: int, slot_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values `[T, num_kv_heads, head_dim]` of one layer into their slots."""
        heads = torch.arange(self.spec.num_kv_heads, device=slot_rows.device) * self._head_stride
        key_rows = (slot_rows[:, None] + heads[None, :]).flatten() + self.key_row_offset(layer)
        dim = self.spec.head_dim
        self._rows.index_copy_(0, key_rows, k.reshape(-1, dim))
        self._rows.index_copy_(0, key_rows + self.spec.block_size, v.reshape(-1, dim))

    def layer_latent(self, layer: int) -> torch.Tensor:
        """MLA (one plane): strided view `[num_blocks, block_size, 1, head_dim]` of one layer."""
        return self.tensor[:, :, layer, 0].transpose(1, 2)

    def write_latent(self, layer: int, slot_rows: torch.Tensor, entry: torch.Tensor) -> None:
        """MLA (one plane): store new entries `[T, head_dim]` of one layer into their slots."""
        self._rows.index_copy_(0, slot_rows + layer * self.spec.block_size, entry)

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def block_bytes(self, block_id: int) -> bytes:
        """A copy of one block's bytes (tests and debugging; transfers use `data_ptr`)."""
        flat = self.tensor[block_id].contiguous().view(torch.uint8)
        return bytes(flat.cpu().numpy().tobytes())
