"""`python -m benchmarks attention [--quick] [--json]`: paged decode attention on a CUDA device
— the engine's Triton kernel (engine/kernels/gpu/decode_attention.py) against the bytes it must
read and against the kernels it could have been instead, in one run.

For the KV heads of Llama-3.1-8B (32 query heads, 8 KV heads, head dim 128) and Llama-3.2-1B
(head dim 64), in bfloat16, blocks of 16 tokens scattered over the cache in random order, each
case (batch x context length) times one layer's decode attention:

- `ours`: the engine's kernel on the engine's own cache views (PagedKVCache.layer_kv: strided,
  a block's heads and layers in one byte range);
- `floor`: the keys and values the step must read / the device copy rate measured in the same
  run (pdcluster/benchmarks/gpu_bench.py), and `ours_vs_floor`;
- `gather_sdpa`: each sequence's blocks gathered into a padded tensor, then torch's
  `scaled_dot_product_attention` (what the engine did before it had a kernel);
- `flashinfer`: FlashInfer's `BatchDecodeWithPagedKVCacheWrapper` where the `flashinfer`
  package imports (it is not a dependency), on the same views, or on a contiguous copy of
  them where it refuses strided ones (`flashinfer_layout` says which);
- `flash_attn`: FlashAttention's `flash_attn_with_kvcache` with a block table, where
  `flash_attn` imports;

each with its largest difference from `ours` (`*_max_diff`); a library that is missing or
refuses the case is reported with its reason instead of a time. Times are medians of CUDA-event
timings, in microseconds.

API: `run(args) -> dict`, `measure(case, device, repeats) -> dict` (runs on CPU through
Triton's interpreter, for tests: there its times mean nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Case:
    shape: str
    batch: int
    context: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    @property
    def name(self) -> str:
        return f"{self.shape}/b{self.batch}x{self.context}"

    @property
    def kv_bytes(self) -> int:
        """The keys and values a decode step of one layer reads."""
        return (2 * self.batch * self.context * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)


def cases(quick: bool) -> list[Case]:
    sizes = [(1, 1024), (16, 1024)] if quick else \
        [(1, 1024), (1, 8192), (16, 2048), (64, 1024), (64, 4096)]
    return [Case(shape, batch, context, head_dim=dim)
            for shape, dim in (("llama-8b", 128), ("llama-1b", 64)) for batch, context in sizes]


@dataclass(slots=True)
class Inputs:
    """One layer's paged cache (the engine's views into a two-layer region), the queries,
    block tables and lengths of one case."""

    q: torch.Tensor  # [batch, heads, dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, dim], strided
    v_cache: torch.Tensor
    table: torch.Tensor  # [batch, blocks per sequence] int32
    lens: torch.Tensor  # [batch] int32
    scale: float

    @classmethod
    def make(cls, case: Case, device: torch.device, seed: int = 0) -> Inputs:
        from pdcluster.engine.kv.kv_cache import KVCacheSpec, PagedKVCache

        per_seq = -(-case.context // BLOCK_SIZE)
        num_blocks = case.batch * per_seq
        spec = KVCacheSpec(num_blocks, 2, BLOCK_SIZE, case.num_kv_heads, case.head_dim,
                           case.dtype.itemsize)
        cache = PagedKVCache(spec, case.dtype, device)
        gen = torch.Generator(device=device).manual_seed(seed)
        cache.rows.copy_(torch.randn(cache.rows.shape, generator=gen, device=device,
                                     dtype=case.dtype))
        k_cache, v_cache = cache.layer_kv(0)
        order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        table = order.view(case.batch, per_seq).contiguous()
        lens = torch.full((case.batch,), case.context, dtype=torch.int32, device=device)
        q = torch.randn(case.batch, case.num_heads, case.head_dim, generator=gen,
                        device=device, dtype=case.dtype)
        return cls(q, k_cache, v_cache, table, lens, case.head_dim ** -0.5)


def ours(x: Inputs) -> Callable[[], torch.Tensor]:
    from pdcluster.engine.kernels import gpu

    kernel = gpu.ops().paged_attention
    batch, heads, dim = x.q.shape
    rows = x.q.view(batch, x.k_cache.shape[2], heads // x.k_cache.shape[2], dim)
    max_len = int(x.lens.max())
    return lambda: kernel(rows, x.k_cache, x.v_cache, x.table, x.lens, x.scale,
                          max_len)[0].view(batch, heads, dim)


def gather_sdpa(x: Inputs) -> Callable[[], torch.Tensor]:
    """Gather every sequence's blocks, pad to the longest, attend with SDPA (GQA)."""
    batch, heads, dim = x.q.shape
    width = x.table.shape[1] * BLOCK_SIZE
    positions = torch.arange(width, device=x.q.device)
    mask = (positions[None, :] < x.lens[:, None])[:, None, None, :]  # [batch, 1, 1, width]
    table = x.table.long()

    def step() -> torch.Tensor:
        keys = x.k_cache[table].flatten(1, 2).transpose(1, 2)  # [batch, kv_heads, width, dim]
        values = x.v_cache[table].flatten(1, 2).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            x.q[:, :, None, :], keys, values, attn_mask=mask, scale=x.scale, enable_gqa=True)
        return out[:, :, 0, :]

    return step


def flashinfer_decode(x: Inputs) -> tuple[Callable[[], torch.Tensor], str]:
    """FlashInfer's paged decode on the engine's views, or on a contiguous copy where it
    refuses them; (the step, the layout used)."""
    import flashinfer

    batch, heads, dim = x.q.shape
    kv_heads, per_seq = x.k_cache.shape[2], x.table.shape[1]
    device = x.q.device
    indptr = torch.arange(0, (batch + 1) * per_seq, per_seq, dtype=torch.int32, device=device)
    last = x.lens - (per_seq - 1) * BLOCK_SIZE
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, x.table.flatten(), last.to(torch.int32), heads, kv_heads, dim,
                 BLOCK_SIZE, pos_encoding_mode="NONE", sm_scale=x.scale,
                 q_data_type=x.q.dtype, kv_data_type=x.k_cache.dtype)
    try:
        wrapper.run(x.q, (x.k_cache, x.v_cache))
        caches, layout = (x.k_cache, x.v_cache), "engine views"
    except Exception:  # noqa: BLE001 - a version that wants contiguous pages
        caches, layout = (x.k_cache.contiguous(), x.v_cache.contiguous()), "contiguous copy"
    return (lambda: wrapper.run(x.q, caches)), layout


def flash_attn_decode(x: Inputs) -> Callable[[], torch.Tensor]:
    from flash_attn import flash_attn_with_kvcache

    def step() -> torch.Tensor:
        return flash_attn_with_kvcache(x.q[:, None], x.k_cache, x.v_cache,
                                       cache_seqlens=x.lens, block_table=x.table,
                                       softmax_scale=x.scale)[:, 0]

    return step


def median_us(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """Median time of `fn` in microseconds: CUDA events on a GPU (gpu_bench.median_time), the
    wall clock elsewhere."""
    if torch.cuda.is_available():
        from pdcluster.benchmarks.gpu_bench import median_time

        return median_time(fn, repeats) * 1e6
    fn()  # warm-up (the interpreter's first launch)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times)


def measure(case: Case, device: torch.device, repeats: int, copy_gb_s: float | None = None
            ) -> dict:
    """One case: each implementation's time, its difference from ours, and the KV floor."""
    x = Inputs.make(case, device)
    mine = ours(x)
    reference = mine().float()
    fields: dict = {"ours_us": round(median_us(mine, repeats), 1)}
    if copy_gb_s:
        floor_us = case.kv_bytes / (copy_gb_s * 1e9) * 1e6
        fields.update(floor_us=round(floor_us, 1),
                      ours_vs_floor=round(fields["ours_us"] / floor_us, 2))
    others: dict[str, Callable[[], tuple[Callable[[], torch.Tensor], str | None]]] = {
        "gather_sdpa": lambda: (gather_sdpa(x), None)}
    if importlib.util.find_spec("flashinfer") is not None:
        others["flashinfer"] = lambda: flashinfer_decode(x)
    else:
        fields["flashinfer"] = "not installed"
    if importlib.util.find_spec("flash_attn") is not None:
        others["flash_attn"] = lambda: (flash_attn_decode(x), None)
    else:
        fields["flash_attn"] = "not installed"
    for name, build in others.items():
        try:
            step, layout = build()
            diff = (step().float() - reference).abs().max().item()
            fields[f"{name}_us"] = round(median_us(step, repeats), 1)
        except Exception as exc:  # noqa: BLE001 - a library refusing a case is a finding
            fields[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        fields[f"{name}_max_diff"] = round(diff, 4)
        fields[f"ours_vs_{name}"] = round(fields["ours_us"] / fields[f"{name}_us"], 2)
        if layout is not None:
            fields[f"{name}_layout"] = layout
    return fields


def run(args: argparse.Namespace) -> dict:
    from pdcluster.cluster.cli_common import UsageError

    if not torch.cuda.is_available():
        raise UsageError("needs a CUDA device: the kernel's times mean something only there")
    from pdcluster.benchmarks.gpu_bench import ceilings

    limits = ceilings()
    device = torch.device("cuda")
    result: dict = {"gpu": torch.cuda.get_device_name(device),
                    "copy_gb_s": limits["copy_gb_s"], "block_size": BLOCK_SIZE}
    repeats = 10 if args.quick else 50
    for case in cases(args.quick):
        for key, value in measure(case, device, repeats, limits["copy_gb_s"]).items():
            result[f"{case.name}/{key}"] = value
        torch.cuda.empty_cache()
    return result
