"""A scheduled step turned into the model's inputs: the flattened token ids and positions, each
new token's cache slot, the decode rows' block tables and context lengths, each prefill chunk's
table, and the rows whose hidden states are sampled.

Tokens are ordered decode-first (every single-token chunk, including a prompt whose only
uncached token is its last), then prefill chunks; see `engine.models.attention`. The host side
is built with numpy (a Python loop over requests, none over tokens) and crosses to the device in
a few copies, whatever the batch size.

API: `StepInputs`, `StepPlan`, `build_inputs(items, kv_cache)`, `lookahead_inputs(items,
kv_cache)`, `decode_table(items, lens, block_size)`, `chunk_tables(inputs, total_rows)`,
`to_device(array, device)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdcluster.engine.core.scheduler_output import ScheduledRequest
from pdcluster.engine.kv.kv_cache import PagedKVCache


@dataclass(slots=True)
class StepInputs:
    """The host arrays of one step (int64 unless said otherwise)."""

    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_rows: np.ndarray  # [T] see PagedKVCache.slot_rows
    last_rows: list[int]  # per item: the row whose hidden state it samples from
    num_decodes: int
    decode_lens: np.ndarray  # [num_decodes] context lengths (position + 1)
    chunks: list[tuple[int, int, list[int]]]  # per prefill chunk: (first row, first pos, blocks)


@dataclass(slots=True)
class StepPlan:
    """What every tensor-parallel rank needs to run a step's forward pass: the inputs, the
    decode rows' block table, the rows whose logits the step samples or verifies (in that
    order), and whether it replays a CUDA graph."""

    inputs: StepInputs
    decode_table: np.ndarray | None  # [num_decodes, max_blocks] int64
    logit_rows: np.ndarray  # int64
    replay: bool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_inputs(items: list[ScheduledRequest], kv_cache: PagedKVCache) -> StepInputs:
    """`items` decode-first (single-token chunks, then the rest)."""
    block_size, per_block = kv_cache.spec.block_size, kv_cache.rows_per_block
    total = sum(it.num_tokens for it in items)
    token_ids = np.empty(total, np.int64)
    positions = np.empty(total, np.int64)
    slot_rows = np.empty(total, np.int64)
    last_rows: list[int] = []
    chunks: list[tuple[int, int, list[int]]] = []
    row = 0
    for it in items:
        n, start = it.num_tokens, it.start
        blocks = it.block_ids[: cdiv(start + n, block_size)]
        token_ids[row: row + n] = it.token_ids
        pos = np.arange(start, start + n)
        positions[row: row + n] = pos
        slot_rows[row: row + n] = (np.asarray(blocks, np.int64)[pos // block_size] * per_block
                                   + pos % block_size)
        if n > 1:
            chunks.append((row, start, blocks))
        row += n
        last_rows.append(row - 1)
    num_decodes = len(items) - len(chunks)
    decode_lens = positions[:num_decodes] + 1
    return StepInputs(token_ids, positions, slot_rows, last_rows, num_decodes, decode_lens,
                      chunks)


def lookahead_inputs(items: list[ScheduledRequest], kv_cache: PagedKVCache) -> StepInputs:
    """The inputs of a decode step launched before its tokens reach the host
    (engine/runner/lookahead.py): each item decodes position `start`, whose token is still on
    the device; `token_ids` are zeros, which the device's tokens replace."""
    block_size, per_block = kv_cache.spec.block_size, kv_cache.rows_per_block
    n = len(items)
    positions = np.fromiter((it.start for it in items), np.int64, n)
    blocks = np.fromiter((it.block_ids[it.start // block_size] for it in items), np.int64, n)
    slot_rows = blocks * per_block + positions % block_size
    return StepInputs(np.zeros(n, np.int64), positions, slot_rows, list(range(n)), n,
                      positions + 1, [])


def decode_table(items: list[ScheduledRequest], lens: np.ndarray, block_size: int
                 ) -> np.ndarray:
    """`[len(items), max_blocks]` block ids of each decode row's context, zero-padded."""
    num_blocks = [cdiv(int(length), block_size) for length in lens]
    table = np.zeros((len(items), max(num_blocks, default=0)), np.int64)
    for row, (it, n) in enumerate(zip(items, num_blocks, strict=True)):
        table[row, :n] = it.block_ids[:n]
    return table


def chunk_tables(inputs: StepInputs, total_rows: int) -> tuple[np.ndarray, np.ndarray,
                                                                np.ndarray, int]:
    """The prefill chunks as the Triton varlen kernel reads them: `(block_tables [C, W] int32,
    q_starts [C + 1] int32, first_pos [C] int32, max_chunk_len)`."""
    chunks = inputs.chunks
    width = max(len(blocks) for _, _, blocks in chunks)
    tables = np.zeros((len(chunks), width), np.int32)
    starts = np.empty(len(chunks) + 1, np.int32)
    first = np.empty(len(chunks), np.int32)
    for c, (row, pos, blocks) in enumerate(chunks):
        tables[c, : len(blocks)] = blocks
        starts[c], first[c] = row, pos
    starts[-1] = total_rows
    return tables, starts, first, int(np.diff(starts).max())


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` (an asynchronous copy from pinned memory on CUDA)."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
