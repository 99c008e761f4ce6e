"""Tensor parallelism inside a model (Megatron-style): each rank holds a slice of every large
weight, and two collectives per layer put the pieces back together.

- `ColumnParallelLinear`: the output features split over ranks (q/k/v by heads, gate/up by
  the intermediate size); no communication, each rank keeps its part of the output.
- `RowParallelLinear`: the input features split (the output projection, the down projection);
  each rank's partial product is summed over ranks (all-reduce), the bias added once after.
- `VocabParallelEmbedding` and the LM head: the vocabulary split; a token's row comes from the
  rank that holds it (all-reduce of masked lookups), the logits are gathered.
- KV heads split with the query heads; with fewer KV heads than ranks each KV head is held by
  `tp / num_kv_heads` ranks (replicated), as vLLM does.

Every sharded module records which slice of the checkpoint tensors it holds (`shard_slices`,
a `ShardSlice` per fused part of the output rows, or `weight_shard`: the dimension and first
index of its weight's slice), which is what the loader (engine/models/loader.py) reads. With
one rank every layer computes what the plain one does.

API: `TensorParallel`, `SINGLE`, `ShardSlice`, `even_slice`, `head_slice`,
`ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`, `local_heads`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.models.linear import Linear, linear


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group (`group` None with one rank)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size} ranks")

    def split(self, n: int, what: str) -> int:
        """`n / size`; ValueError naming `what` when it does not divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size "
                             f"{self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks, in place (the group is used directly, not registered
        in torch.distributed's global state: several engines may live in one process)."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


@dataclass(frozen=True, slots=True)
class ShardSlice:
    """Rows `[start, start + length)` of a checkpoint tensor of `full` rows."""

    full: int
    start: int
    length: int


def even_slice(full: int, tp: TensorParallel, what: str) -> ShardSlice:
    length = tp.split(full, what)
    return ShardSlice(full, tp.rank * length, length)


def local_heads(num_heads: int, tp: TensorParallel, what: str) -> int:
    """Heads this rank holds: `num_heads / tp`, or one (replicated) when there are fewer heads
    than ranks, which must then divide the ranks."""
    if num_heads >= tp.size:
        return tp.split(num_heads, what)
    if tp.size % num_heads:
        raise ValueError(f"{what} ({num_heads}) must divide tensor_parallel_size {tp.size} "
                         "to be replicated over the ranks")
    return 1


def head_slice(num_heads: int, head_dim: int, tp: TensorParallel, what: str) -> ShardSlice:
    """The rows of this rank's heads in a `[num_heads * head_dim, ...]` weight."""
    heads = local_heads(num_heads, tp, what)
    first = tp.rank * heads if num_heads >= tp.size else tp.rank * num_heads // tp.size
    return ShardSlice(num_heads * head_dim, first * head_dim, heads * head_dim)


class ColumnParallelLinear(Linear):
    """A Linear holding, for each fused part (q, k, v; or gate, up), this rank's slice of its
    output rows side by side. `shard_sizes` are the local sizes (the model's view),
    `shard_slices` where each comes from in the checkpoint (the loader's)."""

    def __init__(self, in_features: int, shard_slices: list[ShardSlice], bias: bool) -> None:
        super().__init__(in_features, sum(s.length for s in shard_slices), bias=bias)
        self.shard_slices = shard_slices
        self.shard_sizes = [s.length for s in shard_slices]


class RowParallelLinear(Linear):
    """A Linear holding this rank's slice of the input features: partial products summed over
    the ranks (unless `reduce` is False: the caller sums several partials at once), the bias
    added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 reduce: bool = True) -> None:
        local = tp.split(in_features, "input features")
        super().__init__(local, out_features, bias=bias)
        self.tp, self.reduce = tp, reduce
        self.weight_shard = (1, tp.rank * local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        out = linear(x, self.weight, None)
        if self.reduce:
            self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """An Embedding of this rank's rows of the vocabulary (`vocab / tp` each)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        local = tp.split(vocab_size, "vocab_size")
        # A weight given: nn.Embedding's random init is skipped (the loader fills every
        # weight; on the meta device that init would import torch's compiler, two seconds).
        super().__init__(local, hidden, _weight=torch.empty(local, hidden))
        self.tp, self.first = tp, tp.rank * local
        self.weight_shard = (0, self.first)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside[:, None], 0.0))
