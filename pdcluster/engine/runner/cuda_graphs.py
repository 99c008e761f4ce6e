"""CUDA graphs of the decode step, one per batch-size bucket (1, 2, 4, 8, then every 8 to 64,
every 16 to 128, every 32 beyond; the largest is the engine's `max_num_seqs`).

A decode step launches a few hundred small kernels (per layer: norm, qkv GEMM, RoPE + cache
write, attention, output GEMM, norm, gate/up GEMM, SwiGLU, down GEMM); eagerly each costs a
Python dispatch that takes longer than the kernel. A graph records them once and replays them in
one launch. Everything a replay reads lives in static buffers captured with the graph: token ids,
positions, cache slots, block tables (one row per sequence, wide enough for `max_model_len`)
and context lengths. A batch of n runs in the smallest bucket b >= n: rows n..b-1 are padding
whose keys and values go to the cache's scratch block (`PagedKVCache.scratch_slot_row`) and
whose context is empty. The attention kernel's split count depends only on shapes, so one
capture serves every context length. All graphs share one memory pool (their activations are
never alive at once); capture runs at start-up, largest bucket first, and logs its time and
the memory it took.

What a graph cannot hold runs eagerly: prefill chunks and mixed steps, verification of
proposed tokens, batches beyond the largest bucket, and layers whose step gathers by
data-dependent shapes (`graph_blocker`: MLA expanding its latent, `absorb_decode=False`). MoE
layers are held: their experts are grouped on the device (engine/kernels/gpu/fused_moe.py),
without a host sync; so is MLA's absorbed decode, which reads the latent cache in place.

API: `batch_buckets(max_batch)`, `graph_blocker(model, kv_cache)`, `layers_blocker(model)`,
`DecodeGraphs`.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left

import numpy as np
import torch

from pdcluster.engine import kernels
from pdcluster.engine.kernels import gpu
from pdcluster.engine.kv.kv_cache import PagedKVCache
from pdcluster.engine.models.attention_meta import AttentionMetadata, GatherWorkspace
from pdcluster.engine.models.llama import Attention, CausalLM
from pdcluster.engine.models.mla import MLAttention
from pdcluster.engine.models.moe import MLP, SparseMoE
from pdcluster.engine.runner.inputs import StepInputs, cdiv

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, every 8 to 64, every 16 to 128, every 32 beyond,
    up to and including `max_batch`."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, 129, 16), *range(160, max_batch + 1, 32)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def graph_blocker(model: CausalLM, kv_cache: PagedKVCache) -> str | None:
    """Why this model's decode step cannot be a CUDA graph here, or None when it can."""
    if not kv_cache.tensor.is_cuda:
        return "CUDA graphs need a CUDA device"
    if not kernels.ENABLED:
        return "the engine's kernels are turned off"
    if not gpu.serves(kv_cache.tensor):
        return "the GPU kernels are not available (triton is not installed)"
    return layers_blocker(model)


def layers_blocker(model: CausalLM) -> str | None:
    """Why one of the model's layers cannot run in a CUDA graph, or None when all can."""
    for layer in model.layers:
        attention = layer.self_attn
        if type(attention) is MLAttention and not attention.absorb_decode:
            return "MLA layers that expand the latent for decodes run eagerly"
        if type(attention) not in (Attention, MLAttention):
            return f"{type(attention).__name__} layers run eagerly"
        if not isinstance(layer.mlp, MLP | SparseMoE):
            return f"{type(layer.mlp).__name__} layers run eagerly"
    return None


class DecodeGraphs:
    """The captured graphs and the static buffers they read (see the module doc)."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, max_batch: int,
                 max_model_len: int) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        device = kv_cache.tensor.device
        width = cdiv(max_model_len, kv_cache.spec.block_size)
        # ids, positions, slot rows, context lengths: one pinned staging row each, one copy
        pinned = device.type == "cuda"
        self._host = torch.zeros((4, self.max_batch), dtype=torch.int64, pin_memory=pinned)
        self._host_table = torch.zeros((self.max_batch, width), dtype=torch.int32,
                                       pin_memory=pinned)
        self._inputs = torch.zeros((4, self.max_batch), dtype=torch.int64, device=device)
        self._table = torch.zeros((self.max_batch, width), dtype=torch.int32, device=device)
        # Recorded after each replay's copies out of the pinned staging rows: a replay launched
        # ahead may still be queued when the next one fills them.
        self._staged: torch.cuda.Event | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._pad_inputs(0, self.max_batch)
        self._inputs.copy_(self._host)

    def capture(self) -> None:
        device = self.kv_cache.tensor.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = None
        for size in reversed(self.buckets):
            self._forward(size)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self._graphs[size] = graph
        torch.cuda.synchronize(device)
        taken = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s, %.0f MiB",
                    len(self.buckets), self.max_batch, time.perf_counter() - start,
                    taken / 2**20)

    def bucket(self, num_seqs: int) -> int:
        """The smallest captured batch size that holds `num_seqs` sequences."""
        return self.buckets[bisect_left(self.buckets, num_seqs)]

    def replay(self, inputs: StepInputs, table: np.ndarray,
               token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[n, vocab]` (float32) of a decode-only step of n <= max_batch sequences;
        `table` is their `[n, w]` block table. `token_ids`: the step's tokens already on the
        device (a step launched ahead, engine/runner/lookahead.py), used instead of
        `inputs.token_ids`."""
        n = len(inputs.token_ids)
        size = self.bucket(n)
        if self._staged is not None:  # the last replay's copies out of the staging rows
            self._staged.synchronize()
        host = self._host.numpy()
        host[0, :n], host[1, :n] = inputs.token_ids, inputs.positions
        host[2, :n], host[3, :n] = inputs.slot_rows, inputs.decode_lens
        self._pad_inputs(n, size)
        width = table.shape[1]
        self._host_table.numpy()[:n, :width] = table
        self._inputs[:, :size].copy_(self._host[:, :size], non_blocking=True)
        self._table[:n, :width].copy_(self._host_table[:n, :width], non_blocking=True)
        if token_ids is not None:
            self._inputs[0, :n].copy_(token_ids)
        if self._host.is_pinned():
            self._staged = torch.cuda.Event()
            self._staged.record()
        graph = self._graphs.get(size)
        if graph is None:  # not captured (off CUDA: the same forward, eagerly, for tests)
            return self._forward(size)[:n]
        graph.replay()
        return self._logits[size][:n]

    def replay_seconds(self, size: int, repeats: int = 50) -> float:
        """The device time of one replay of bucket `size` over the inputs in place (median of
        `repeats`, CUDA events): a decode step without the host's part, for benchmarks."""
        graph = self._graphs[size]
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    def _pad_inputs(self, n: int, size: int) -> None:
        """Rows n..size-1: token 0 at position 0, written to the scratch slot, no context."""
        host = self._host.numpy()
        host[0:2, n:size] = 0
        host[2, n:size] = self.kv_cache.scratch_slot_row
        host[3, n:size] = 0

    def _forward(self, size: int) -> torch.Tensor:
        ids, positions, slot_rows, lens = self._inputs[:, :size]
        meta = AttentionMetadata(slot_rows=slot_rows, num_decodes=size,
                                 decode_block_table=self._table[:size], decode_lens=lens,
                                 prefills=[], workspace=GatherWorkspace())
        hidden = self.model(ids, positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden)
