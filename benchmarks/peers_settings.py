"""One set of serving settings for every engine `bench peers` measures, translated into each
engine's own options (`PeerSettings.launch(engine)`), so that no engine runs on defaults the
others do not share:

- threads: pdcluster and transformers: torch threads; vLLM: `OMP_NUM_THREADS` and
  `VLLM_CPU_OMP_THREADS_BIND=0-(n-1)` (its default keeps a core for its scheduler); llama.cpp:
  `n_threads`, `n_threads_batch`.
- dtype (float32): `dtype` for pdcluster, vLLM and transformers; llama.cpp runs its GGUF (Q4_1,
  speed only).
- token budget and sequences per step: `max_num_batched_tokens`, `max_num_seqs` for pdcluster
  and vLLM (vLLM's own default budget differs); llama.cpp: `n_batch`, one sequence at a time.
- KV cache bytes: pdcluster `kv_cache_memory_gib`, vLLM `VLLM_CPU_KVCACHE_SPACE` (whole GiB);
  longest sequence `max_model_len` (llama.cpp: `n_ctx`); prefix caching on for both.
- detokenization off: `SamplingParams(detokenize=False)` in pdcluster and vLLM (token ids only;
  vLLM otherwise detokenizes every step); transformers and llama.cpp return ids.
- allocator preload: vLLM: tcmalloc and the venv's libiomp5 (its CPU docs); pdcluster: what
  docs/engine.md advises; transformers and llama.cpp: none.

Each engine's preload is what its own project advises; `preload=False` runs
every engine without one. The bench reports the launch of each engine in its JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
ENGINES = ("pdcluster", "vllm", "hf", "llamacpp")


@dataclass(frozen=True, slots=True)
class Launch:
    """How to start one engine: its constructor options, the extra sampling options of every
    request, and its process environment (a subprocess; in-process engines take none)."""

    options: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PeerSettings:
    threads: int = 2
    dtype: str = "float32"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 32
    kv_cache_gib: int = 4  # vLLM's CPU KV space is whole GiB
    max_model_len: int = 2112
    enable_prefix_caching: bool = True
    detokenize: bool = False
    seed: int = 0
    preload: bool = True  # each engine's advised allocator preload

    def __post_init__(self) -> None:
        for name in ("threads", "max_num_batched_tokens", "max_num_seqs", "kv_cache_gib",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype != "float32":
            raise ValueError(f"bench peers compares float32 runs only, got dtype {self.dtype!r}")
        if self.detokenize:
            raise ValueError("bench peers times token ids: detokenize must stay off")

    def to_dict(self) -> dict:
        return asdict(self)

    def launch(self, engine: str, model: str, venv: Path | None = None,
               gguf: str | None = None) -> Launch:
        """`engine`'s translation of these settings (`venv`: a peer's virtual environment,
        where its preload libraries live)."""
        if engine == "pdcluster":
            return self._pdcluster(model)
        if engine == "vllm":
            return self._vllm(model, venv)
        if engine == "hf":
            return Launch({"model": model, "dtype": self.dtype, "threads": self.threads})
        if engine == "llamacpp":
            return Launch({"model_path": gguf, "n_threads": self.threads,
                           "n_threads_batch": self.threads, "n_ctx": self.max_model_len,
                           "n_batch": min(self.max_num_batched_tokens, 512)},
                          env=self._threads_env())
        raise ValueError(f"unknown engine {engine!r}; known: {ENGINES}")

    def _threads_env(self) -> dict:
        return {"OMP_NUM_THREADS": str(self.threads)}

    def _pdcluster(self, model: str) -> Launch:
        options = {"model": model, "device": "cpu", "dtype": self.dtype,
                   "max_num_seqs": self.max_num_seqs,
                   "max_num_batched_tokens": self.max_num_batched_tokens,
                   "kv_cache_memory_gib": float(self.kv_cache_gib),
                   "max_model_len": self.max_model_len,
                   "enable_prefix_caching": self.enable_prefix_caching, "seed": self.seed}
        env = {**self._threads_env(), **pdcluster_preload(self.preload)}
        return Launch(options, {"detokenize": self.detokenize}, env)

    def _vllm(self, model: str, venv: Path | None) -> Launch:
        options = {"model": model, "dtype": self.dtype, "seed": self.seed,
                   "max_num_seqs": self.max_num_seqs,
                   "max_num_batched_tokens": self.max_num_batched_tokens,
                   "max_model_len": self.max_model_len,
                   "enable_prefix_caching": self.enable_prefix_caching}
        env = {**self._threads_env(), "VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}",
               "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}
        if self.preload:
            env |= vllm_preload(venv)
        return Launch(options, {"detokenize": self.detokenize}, env)


def vllm_preload(venv: Path | None) -> dict:
    """vLLM's CPU docs: tcmalloc and the venv's Intel OpenMP, both preloaded, where both exist
    (~8% measured here)."""
    iomp = sorted(venv.glob("lib/libiomp5.so")) if venv is not None else []
    if TCMALLOC.is_file() and iomp:
        return {"LD_PRELOAD": f"{TCMALLOC}:{iomp[0]}"}
    return {}


def pdcluster_preload(preload: bool) -> dict:
    """What docs/engine.md advises for the engine on CPU: tcmalloc, where installed."""
    if preload and TCMALLOC.is_file():
        return {"LD_PRELOAD": str(TCMALLOC)}
    return {}
