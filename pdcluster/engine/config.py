"""`EngineConfig`: every engine option, validated once at construction. Values derived at run
time (the number of KV blocks, the resolved dtype and device) are returned by the engine, not
written back here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from pdcluster.core.hashing import DEFAULT_HASH_CONFIG, HashConfig
from pdcluster.core.vllm_hashing import VLLM_DEFAULT_SEED, VLLM_HASH_ALGORITHM
from pdcluster.engine.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# "auto": the checkpoint's weights; "dummy": random weights of the config's shapes (only
# config.json is read), for benchmarks and capacity tests without a checkpoint.
LOAD_FORMATS = ("auto", "dummy")
# The engine a node runs: the project's own (this package) or vLLM (pdcluster.vllm_backend).
BACKENDS = ("pdcluster", "vllm")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    # "pdcluster" (the own engine) or "vllm" (vLLM behind the same node interface). A vLLM
    # node hashes blocks as vLLM does (`core.vllm_hashing`), which the defaults below switch to.
    backend: str = "pdcluster"
    dtype: str = "auto"  # float32 on CPU; the checkpoint's half type (else bfloat16) on CUDA
    device: str = "auto"  # cuda when available, else cpu
    load_format: str = "auto"  # see LOAD_FORMATS
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gib
    kv_cache_memory_gib: float | None = None  # None: 1 GiB on CPU, 90% of free memory on CUDA
    # The host tier below the device's KV cache (engine/core/kv_tiers.py): blocks the device evicts
    # are copied there and loaded back on a prefix hit. Sized in GiB of host memory, or in
    # blocks (num_host_blocks wins); 0 / None: no host tier. With tensor parallelism each rank
    # keeps its slice of a block in its own host tier: the GiB are every rank's together (as
    # are disk_cache_gib's).
    host_cache_gib: float = 0.0
    num_host_blocks: int | None = None
    # The disk tier below the host tier (engine/kv/disk_kv_cache.py): blocks the host evicts are
    # written to one preallocated file in disk_cache_dir's own 0700 subfolder kv-disk/
    # (None: core.paths' cache dir) by a writer thread, at most disk_max_pending_writes at a
    # time (more are dropped, never waited for). In GiB of disk, or in blocks
    # (num_disk_blocks wins); 0 / None: no disk tier. Wiped at every start.
    disk_cache_gib: float = 0.0
    num_disk_blocks: int | None = None
    disk_cache_dir: str | None = None
    disk_max_pending_writes: int = 64
    max_model_len: int | None = None  # None: the model's own limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False
    hash_algorithm: str = "sha256"
    hash_seed: str = "pdcluster-v1"
    seed: int = 0
    max_logprobs: int = 20  # the most top logprobs a request may ask for (vLLM's default)
    # KV blocks held for other nodes (sends to decode nodes, prefix pulls served): at most
    # this fraction of the pool, each send pin for at most `pin_timeout_s` (engine/core/pins.py).
    max_pinned_fraction: float = 0.5
    pin_timeout_s: float = 10.0
    # Speculative decoding (engine/spec_decode): a SpeculativeConfig or its text form
    # ("ngram:k=4", "draft:PATH,k=4"), turned into the config here; None: off.
    speculative: SpeculativeConfig | str | None = None
    # Tensor parallelism: the model split over this many ranks (processes the engine starts,
    # engine/runner/tp_workers.py; one GPU each on CUDA); vLLM: its own.
    tensor_parallel_size: int = 1
    # The own engine's ranks: a collective (or a rank's answer) that waits this long for a rank
    # fails the step with TensorParallelError, which takes the node down (a stalled rank is
    # caught, never a hang). vLLM: its own.
    tensor_parallel_timeout_s: float = 120.0
    # vLLM only (the own engine refuses other values): the share of GPU memory vLLM may take.
    gpu_memory_utilization: float | None = None
    # Both engines, on CUDA: True runs every step eagerly, False (the default) replays decode
    # steps as CUDA graphs captured at start-up (engine/runner/cuda_graphs.py; vLLM: its own).
    # On CPU every step is eager either way (vLLM's CPU build here too: no minute-long compile
    # per engine).
    enforce_eager: bool = False
    # The own engine, on decode graphs: a step of decodes launches the next one on the device
    # before its own tokens reach the host, so the host's bookkeeping runs while the GPU
    # computes (engine/runner/lookahead.py). False: host and GPU take turns. vLLM: its own.
    overlap_decode: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "vllm" and self.hash_algorithm == DEFAULT_HASH_CONFIG.algorithm \
                and self.hash_seed == DEFAULT_HASH_CONFIG.root_seed:
            object.__setattr__(self, "hash_algorithm", VLLM_HASH_ALGORITHM)
            object.__setattr__(self, "hash_seed", VLLM_DEFAULT_SEED)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got "
                             f"{self.load_format!r}")
        if self.backend == "vllm" and self.load_format != "auto":
            raise ValueError("load_format is an option of the own engine (backend: pdcluster)")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be > 0")
        self._validate_tiers()
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        HashConfig(self.hash_algorithm, self.hash_seed)  # validates both
        self._validate_limits()
        object.__setattr__(self, "speculative", SpeculativeConfig.coerce(self.speculative))

    def _validate_tiers(self) -> None:
        if not 0 <= self.host_cache_gib < float("inf"):
            raise ValueError(f"host_cache_gib must be >= 0, got {self.host_cache_gib}")
        if self.num_host_blocks is not None and self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.has_host_tier and self.backend == "vllm":
            raise ValueError("host_cache_gib is the own engine's host tier; a vLLM node "
                             "offloads with vLLM's own connectors (docs/engines.md)")
        if self.has_host_tier and not self.enable_prefix_caching:
            raise ValueError("a host KV tier caches prefixes: it needs enable_prefix_caching")
        if not 0 <= self.disk_cache_gib < float("inf"):
            raise ValueError(f"disk_cache_gib must be >= 0, got {self.disk_cache_gib}")
        if self.num_disk_blocks is not None and self.num_disk_blocks < 0:
            raise ValueError(f"num_disk_blocks must be >= 0, got {self.num_disk_blocks}")
        if self.disk_max_pending_writes < 1:
            raise ValueError(f"disk_max_pending_writes must be >= 1, got "
                             f"{self.disk_max_pending_writes}")
        if self.has_disk_tier and self.backend == "vllm":
            raise ValueError("disk_cache_gib is the own engine's disk tier; a vLLM node "
                             "offloads with vLLM's own connectors (docs/engines.md)")
        if self.has_disk_tier and not self.has_host_tier:
            raise ValueError("the disk KV tier sits below the host tier: set host_cache_gib "
                             "(or num_host_blocks) too")

    @property
    def has_host_tier(self) -> bool:
        return bool(self.num_host_blocks) if self.num_host_blocks is not None \
            else self.host_cache_gib > 0

    @property
    def has_disk_tier(self) -> bool:
        return bool(self.num_disk_blocks) if self.num_disk_blocks is not None \
            else self.disk_cache_gib > 0

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """`speculative` as `__post_init__` left it: a config, or None (never the text)."""
        spec = self.speculative
        assert not isinstance(spec, str), "EngineConfig.__post_init__ parses the text form"
        return spec

    def _validate_limits(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if not 0 < self.max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in (0, 1], got "
                             f"{self.max_pinned_fraction}")
        if not self.pin_timeout_s > 0:
            raise ValueError(f"pin_timeout_s must be > 0, got {self.pin_timeout_s}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if not self.tensor_parallel_timeout_s > 0:
            raise ValueError(f"tensor_parallel_timeout_s must be > 0, got "
                             f"{self.tensor_parallel_timeout_s}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.backend == "pdcluster" and self.gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization is a vLLM option (backend: vllm); the own "
                             "engine sizes its KV cache with kv_cache_memory_gib")

    @classmethod
    def from_options(cls, model: str, options: Mapping[str, Any]) -> EngineConfig:
        """From plain options (a config file's `engine:` section, or what crosses Ray as a
        dict): an unknown or misspelt option is a ValueError naming it, not a TypeError."""
        known = {f.name for f in fields(cls)} - {"model"}  # the model is given on its own
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine options: {unknown}")
        return cls(model=model, **options)

    @property
    def hash_config(self) -> HashConfig:
        return HashConfig(self.hash_algorithm, self.hash_seed)
