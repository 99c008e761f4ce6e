"""What a step's attention needs to know, built once per step by the model runner
(engine/runner/) and shared by every layer (engine/models/attention.py): each new token's cache
slot, the decode rows' block tables and lengths (and the split at blocks they all share, the
cascade), each prefill chunk's context, and on CUDA every chunk at once for the varlen kernel;
plus the reusable gather buffers of the paths that gather.

API: `AttentionMetadata`, `PrefillChunk`, `PrefillBatch`, `CascadeTables`, `GatherWorkspace`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first token of the chunk in the flattened batch
    end: int
    context_len: int  # tokens attended to: cached/earlier tokens + this chunk
    block_ids: torch.Tensor  # [ceil(context_len / block_size)]
    _mask: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor | None:
        """`[chunk_len, context_len]` bool, `key_pos <= query_pos`, built on the device at
        first use (the Triton path never asks); None when the chunk starts at position 0."""
        first = self.context_len - (self.end - self.start)
        if first == 0:
            return None
        if self._mask is None:
            device = self.block_ids.device
            keys = torch.arange(self.context_len, device=device)
            self._mask = keys[None, :] <= torch.arange(first, self.context_len,
                                                       device=device)[:, None]
        return self._mask


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """Every prefill chunk of a step as the Triton varlen kernel reads them (CUDA)."""

    block_tables: torch.Tensor  # [num_chunks, max_blocks] int32
    q_starts: torch.Tensor  # [num_chunks + 1] int32: chunk c is rows q_starts[c]:q_starts[c+1]
    first_pos: torch.Tensor  # [num_chunks] int32: position of each chunk's first token
    max_chunk_len: int


class GatherWorkspace:
    """Reusable output buffers for block gathers, one per `slot` (keys and values of one layer
    are alive together; the next layer's gathers overwrite them). A buffer grows to the
    largest gather seen and is never shrunk: its size is bounded by the largest batch."""

    KEYS, VALUES, SHARED_KEYS, SHARED_VALUES = 0, 1, 2, 3

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def gather(self, cache: torch.Tensor, block_ids: torch.Tensor, slot: int) -> torch.Tensor:
        """[..., n_blocks] ids -> [..., Hkv, n_blocks * block_size, D], a view of the slot's
        buffer (valid until the slot's next gather). index_select, not `cache[block_ids]`:
        advanced indexing of this strided view is ~500x slower on CPU."""
        flat_ids = block_ids.reshape(-1)
        shape = (flat_ids.numel(), *cache.shape[1:])
        numel = shape[0] * cache[0].numel()
        buffer = self._buffers.get(slot)
        if (buffer is None or buffer.numel() < numel or buffer.dtype != cache.dtype
                or buffer.device != cache.device):
            buffer = self._buffers[slot] = torch.empty(numel, dtype=cache.dtype,
                                                       device=cache.device)
        blocks = torch.index_select(cache, 0, flat_ids, out=buffer[:numel].view(shape))
        blocks = blocks.view(*block_ids.shape, *cache.shape[1:])  # [..., n, bs, Hkv, D]
        return blocks.flatten(-4, -3).transpose(-3, -2)


@dataclass(slots=True)
class CascadeTables:
    """Decode attention split at the blocks every decode sequence shares (see the module doc)."""

    shared_block_ids: torch.Tensor  # [n_shared] the leading blocks of every decode's table
    block_table: torch.Tensor  # [num_decodes, max_blocks - n_shared] the rest of each table
    bias: torch.Tensor  # [num_decodes, 1, 1, keys] additive key mask (0 or -inf), query dtype
    own_lens: torch.Tensor  # [num_decodes] int64: tokens of each sequence past the shared ones


@dataclass(slots=True)
class AttentionMetadata:
    slot_rows: torch.Tensor  # [T] each new token's cache slot, see PagedKVCache.slot_rows
    num_decodes: int
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_lens: torch.Tensor | None  # [num_decodes] context lengths
    prefills: list[PrefillChunk]
    workspace: GatherWorkspace
    cascade: CascadeTables | None = None  # set when decodes share leading blocks
    prefill_batch: PrefillBatch | None = None  # set on CUDA, for the Triton prefill kernel
    _decode_mask: torch.Tensor | None = None

    def decode_mask(self, block_size: int) -> torch.Tensor:
        """`[num_decodes, 1, 1, max_blocks * block_size]` bool, True on each sequence's
        keys (for the gathered paths), built on the device at first use."""
        if self._decode_mask is None:
            assert self.decode_block_table is not None and self.decode_lens is not None, \
                "a step with decodes has their tables"
            keys = self.decode_block_table.shape[1] * block_size
            mask = torch.arange(keys, device=self.decode_lens.device)[None, :] \
                < self.decode_lens[:, None]
            self._decode_mask = mask[:, None, None, :]
        return self._decode_mask
