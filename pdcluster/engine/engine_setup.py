"""How an `LLMEngine` turns its `EngineConfig` into parts: the device, the dtype, the longest
sequence, the tokenizer (if the model folder has one) and the size of the paged KV cache.

`kv_cache_spec` fills the configured KV memory (1 GiB on CPU by default, 90% of free memory on
CUDA) with blocks, never more than every sequence slot at full length can use. `host_tier`
builds the host tier below it (engine/core/kv_tiers.py), and the disk tier below that
(engine/kv/disk_kv_cache.py), when the config asks for them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.host_pool import HostBlockPool
from pdcluster.engine.core.kv_cache_manager import cdiv
from pdcluster.engine.core.kv_tiers import KVTiers
from pdcluster.engine.kv.disk_kv_cache import DiskKVCache
from pdcluster.engine.kv.host_kv_cache import HostKVCache, available_host_bytes, host_tier_blocks
from pdcluster.engine.kv.kv_cache import KVCacheSpec, PagedKVCache
from pdcluster.engine.models.llama import CausalLM
from pdcluster.engine.models.loader import load_model
from pdcluster.engine.models.model_config import ModelConfig
from pdcluster.engine.models.parallel import TensorParallel, local_heads
from pdcluster.engine.models.registry import model_class
from pdcluster.engine.runner.tp_workers import RankSpec, StepPeers

_CPU_KV_GIB = 1.0
_CUDA_MEMORY_FRACTION = 0.9


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, mc: ModelConfig) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if mc.torch_dtype == "float16" else torch.bfloat16


def resolve_max_len(config: EngineConfig, mc: ModelConfig) -> int:
    if config.max_model_len is None:
        return mc.max_model_len
    if config.max_model_len > mc.max_model_len:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit "
                         f"{mc.max_model_len}")
    return config.max_model_len


def load_tokenizer(path: str):
    folder = Path(path)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_model(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype,
                device: torch.device, max_model_len: int) -> tuple[CausalLM, StepPeers | None]:
    """This process's model, and with tensor parallelism the other ranks (started here, each
    loading its own slice while this process loads rank 0's)."""
    size, dummy = config.tensor_parallel_size, config.load_format == "dummy"
    if size == 1:
        return load_model(config.model, mc, dtype, device, max_model_len, dummy=dummy), None
    with torch.device("meta"):  # a split that does not divide fails here, before any process
        model_class(mc.architecture)(mc, max_model_len, TensorParallel(0, size))
    spec = RankSpec(config.model, str(dtype).removeprefix("torch."), str(device),
                    max_model_len, config.load_format,
                    threads=max(1, torch.get_num_threads() // size),
                    timeout_s=config.tensor_parallel_timeout_s)
    peers, tp = StepPeers.start(spec, size)
    try:
        model = load_model(config.model, mc, dtype, device, max_model_len, dummy=dummy, tp=tp)
        peers.wait_ready()
    except BaseException:
        peers.close()
        raise
    return model, peers


def kv_cache_spec(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype,
                  device: torch.device, max_model_len: int) -> KVCacheSpec:
    """One rank's KV cache: with tensor parallelism its KV heads (MLA's latent whole)."""
    planes, heads, dim = mc.kv_layout
    if planes == 2 and config.tensor_parallel_size > 1:
        heads = local_heads(heads, TensorParallel(0, config.tensor_parallel_size),
                            "num_key_value_heads")
    spec = KVCacheSpec(1, mc.num_layers, config.block_size, heads, dim,
                       torch.finfo(dtype).bits // 8, planes)
    num_blocks = config.num_kv_blocks or _blocks_for_memory(config, device, max_model_len,
                                                            spec.block_nbytes)
    return dataclasses.replace(spec, num_blocks=num_blocks)


def _blocks_for_memory(config: EngineConfig, device: torch.device, max_model_len: int,
                       block_nbytes: int) -> int:
    gib = config.kv_cache_memory_gib
    if gib is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * _CUDA_MEMORY_FRACTION)
    else:
        budget = int((gib or _CPU_KV_GIB) * 2**30)
    # Never more than every sequence slot at full length needs.
    useful = config.max_num_seqs * cdiv(max_model_len, config.block_size)
    num_blocks = min(budget // block_nbytes, useful)
    if num_blocks < 1:
        raise ValueError("the KV cache memory budget is smaller than one block")
    return num_blocks


def host_tier(config: EngineConfig, pool: BlockPool, kv_cache: PagedKVCache,
              peers: StepPeers | None = None) -> tuple[KVTiers | None, HostKVCache | None]:
    """The host tier's bookkeeping and bytes, or (None, None) without one; ValueError when
    it does not fit in the host memory available (checked after the device cache exists: on
    CPU that cache is host memory too). With tensor parallelism every rank (`peers`) gets a
    tier of the same slots for its slice, and the configured sizes hold all the slices."""
    if not config.has_host_tier:
        return None, None
    num_ranks = config.tensor_parallel_size
    num_blocks = host_tier_blocks(config.host_cache_gib, config.num_host_blocks,
                                  kv_cache.spec.block_nbytes * num_ranks,
                                  available_host_bytes())
    host_cache = HostKVCache(kv_cache, num_blocks)
    host_cache.calibrate()
    disk_pool = None
    if config.has_disk_tier:
        host_cache.disk = disk_tier(config, kv_cache.spec.block_nbytes, num_ranks)
        disk_pool = HostBlockPool(host_cache.disk.num_blocks)
    if peers is not None:
        disk = host_cache.disk
        # the folder rank 0 was given: each rank makes its file in its private subfolder
        peers.start_tiers(num_blocks, disk.num_blocks if disk else 0, config.disk_cache_dir)
        host_cache.peers = peers
    return KVTiers(pool, HostBlockPool(num_blocks), disk_pool, config.disk_max_pending_writes,
                   num_ranks), host_cache


def disk_tier(config: EngineConfig, block_nbytes: int, num_ranks: int = 1) -> DiskKVCache:
    """The disk tier's file, wiped, reserved and calibrated; ValueError when it does not fit
    its directory's free space (with `num_ranks` ranks' files of `block_nbytes` per block)."""
    disk = DiskKVCache.create(config.disk_cache_dir, config.disk_cache_gib,
                              config.num_disk_blocks, block_nbytes, num_ranks)
    disk.calibrate()
    return disk
