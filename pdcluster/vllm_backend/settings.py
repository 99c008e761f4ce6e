"""The node's `EngineConfig` as vLLM's engine arguments, and what vLLM is given besides.

One engine config serves both backends; here it is translated option by option. Options that
only the own engine has (speculative decoding as built here, its pin budget) are refused when
set, never dropped: `check_supported` names each. What vLLM is always given:

- prefix caching with the `sha256_cbor` block hash (`core.vllm_hashing` computes the same
  hashes from tokens, so the router can name this node's blocks);
- pdcluster's KV connector (`pdcluster.vllm_backend.connector`, loaded by module path) in the
  role `kv_both` with `kv_load_failure_policy="recompute"`: a failed remote load recomputes;
- KV cache events published over `ipc://` in a private folder (vLLM's default endpoint is a
  wildcard TCP port, which this project never opens);
- the KV cache layout LBHNC (the connector asks for it: `REQUIRED_LAYOUT`), where each layer's
  block holds its KV heads outermost in one byte run, on CPU and GPU alike;
- eager mode (no torch.compile warm-up of a minute per engine on CPU; CUDA graphs are kept
  on GPUs unless `enforce_eager` is set).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdcluster.core.vllm_hashing import VLLM_DEFAULT_SEED, VLLM_HASH_ALGORITHM
from pdcluster.engine.config import EngineConfig

CONNECTOR_MODULE = "pdcluster.vllm_backend.connector"
CONNECTOR_CLASS = "PdclusterConnector"
GIB = 1 << 30
# vLLM's CPU attention kernels take blocks of a multiple of 32 tokens
# (CPUAttentionBackend.get_supported_kernel_block_sizes).
CPU_BLOCK_MULTIPLE = 32
# vLLM's KV cache layouts (vllm/v1/kv_cache_layout.py) in which a block of one layer is one
# byte run with its KV heads outermost; "HND" is vLLM's older name for LBHNC.
REQUIRED_LAYOUT = "LBHNC"
HEAD_OUTERMOST_LAYOUTS = ("LBHNC", "BLHNC")
_LAYOUT_ALIASES = {"HND": "LBHNC", "NHD": "LBNHC"}


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What pdcluster's connector inside vLLM needs from the node (`kv_connector_extra_config`,
    so every value is plain data). `handshake_dir`: a private folder (mode 0700) where the
    node leaves the CURVE keys for the side channel and the connector's worker leaves its
    KV address (`vllm_backend.handshake`)."""

    handshake_dir: str
    host: str = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""
    timeout_s: float = 30.0
    recompute_on_failure: bool = True
    min_pull_blocks: int = 2
    hash_seed: str = VLLM_DEFAULT_SEED  # the seed vLLM hashes with (lookups hash the same)

    def as_extra_config(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in extra.items() if k in known})


def check_supported(config: EngineConfig) -> None:
    """ValueError naming every option of `config` that the vLLM backend cannot honour."""
    refused = []
    if config.speculative is not None:
        refused.append("speculative (the own engine's speculative decoding)")
    if config.tensor_parallel_timeout_s != 120.0:
        refused.append("tensor_parallel_timeout_s (the own engine's ranks; vLLM's are its own)")
    if not config.overlap_decode:
        refused.append("overlap_decode (the own engine's decode look-ahead; vLLM schedules "
                       "its own)")
    if config.max_pinned_fraction != 0.5 or config.pin_timeout_s != 10.0:
        refused.append("max_pinned_fraction / pin_timeout_s (the own engine's pin budget)")
    if config.hash_algorithm != VLLM_HASH_ALGORITHM:
        refused.append(f"hash_algorithm {config.hash_algorithm!r} (vLLM nodes hash with "
                       f"{VLLM_HASH_ALGORITHM!r})")
    if not config.enable_prefix_caching:
        refused.append("enable_prefix_caching=False (the cluster's index needs it)")
    if config.device == "cpu" and _on_gpu() or config.device.startswith("cuda") and not _on_gpu():
        refused.append(f"device {config.device!r} (this vLLM build runs on "
                       f"{'CUDA' if _on_gpu() else 'the CPU'})")
    if not _on_gpu() and config.block_size % CPU_BLOCK_MULTIPLE:
        refused.append(f"block_size {config.block_size} (vLLM's CPU kernels need a multiple "
                       f"of {CPU_BLOCK_MULTIPLE})")
    layout = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if layout and _LAYOUT_ALIASES.get(layout, layout) not in HEAD_OUTERMOST_LAYOUTS:
        refused.append(f"VLLM_KV_CACHE_LAYOUT={layout} (the connector moves blocks whose KV "
                       f"heads are outermost: {' or '.join(HEAD_OUTERMOST_LAYOUTS)}; unset it)")
    if refused:
        raise ValueError("the vLLM backend does not support: " + "; ".join(refused))
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None and seed != config.hash_seed:
        raise ValueError(f"PYTHONHASHSEED={seed!r} would change vLLM's block hashes; the node "
                         f"is configured with seed {config.hash_seed!r} (unset it)")
    if config.hash_seed != VLLM_DEFAULT_SEED and seed is None:
        raise ValueError(f"hash_seed {config.hash_seed!r}: vLLM takes its seed from "
                         "PYTHONHASHSEED only; set both or neither")


def engine_args(config: EngineConfig, connector: ConnectorSettings, events_dir: Path,
                with_connector: bool = True) -> dict[str, Any]:
    """Keyword arguments of vLLM's `AsyncEngineArgs` for `config` (checked first)."""
    from vllm.config import KVEventsConfig, KVTransferConfig

    check_supported(config)
    args: dict[str, Any] = {
        "model": config.model, "dtype": _dtype(config.dtype), "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_prefix_caching": True, "prefix_caching_hash_algo": "sha256_cbor",
        "seed": config.seed, "max_logprobs": config.max_logprobs,
        "tensor_parallel_size": config.tensor_parallel_size,
        # vLLM's ranks are processes of the node (its actor holds their GPUs), never Ray
        # workers of their own: vLLM would pick Ray inside a placement group.
        "distributed_executor_backend": "mp" if config.tensor_parallel_size > 1 else None,
        "enforce_eager": config.enforce_eager or not _on_gpu(),
        "disable_log_stats": False,  # the node's load reports come from vLLM's stats
        "kv_events_config": KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq",
            endpoint=f"ipc://{events_dir / 'kv-events'}",
            replay_endpoint=f"ipc://{events_dir / 'kv-replay'}", topic="kv"),
    }
    max_len = config.max_model_len or _context_that_fits(config)
    if max_len is not None:
        args["max_model_len"] = max_len
    if config.num_kv_blocks is not None:
        args["num_gpu_blocks_override"] = config.num_kv_blocks
    if config.kv_cache_memory_gib is not None:
        args["kv_cache_memory_bytes"] = int(config.kv_cache_memory_gib * GIB)
    elif not _on_gpu():
        args["kv_cache_memory_bytes"] = GIB  # the own engine's CPU default
    if config.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = config.gpu_memory_utilization
    if with_connector:
        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=connector.as_extra_config())
        # The connector moves one KV cache group (dense attention); vLLM's hybrid manager
        # refuses connectors that do not declare support for several.
        args["disable_hybrid_kv_cache_manager"] = True
    return args


def _context_that_fits(config: EngineConfig) -> int | None:
    """With a KV budget set (and no context length), the longest context it holds, if that is
    shorter than the model's: vLLM refuses to start when one full-length sequence does not
    fit, where the own engine starts and refuses longer prompts. Here vLLM starts with the
    shorter context, and the node refuses prompts past it."""
    if config.kv_cache_memory_gib is None and config.num_kv_blocks is None:
        return None
    import json

    model = json.loads((Path(config.model) / "config.json").read_text())
    text = model.get("text_config", model)
    heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    elem = 4 if _dtype(config.dtype) in ("float32", "auto") else 2
    per_token = 2 * text["num_hidden_layers"] * heads * head_dim * elem
    if config.num_kv_blocks is not None:
        tokens = config.num_kv_blocks * config.block_size
    else:
        tokens = int(config.kv_cache_memory_gib * GIB) // per_token  # type: ignore[operator]
    # vLLM keeps one block of the pool aside (its null block)
    fits = (tokens // config.block_size - 1) * config.block_size
    longest = int(text.get("max_position_embeddings") or fits)
    return fits if fits < longest else None


def _dtype(dtype: str) -> str:
    # The own engine's "auto" is float32 on CPU; vLLM's "auto" would take the checkpoint's.
    if dtype == "auto" and not _on_gpu():
        return "float32"
    return dtype


def _on_gpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())
