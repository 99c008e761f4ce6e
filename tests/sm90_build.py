"""The engine's Triton kernels built for Hopper (sm_90: the H100's and H200's processor) on a
machine without a GPU, and what each build needs from a multiprocessor.

Triton compiles a kernel for the GPU it is launched on, at its first launch. A launch whose tiles
need more shared memory than a multiprocessor gives one block fails there and then ("out of
resources"), and a program that needs more than 255 registers a thread spills to local memory
and slows down, silently. Neither shows in Triton's interpreter, which runs the same kernels on
CPU in `make test`. This module makes the launches the engine makes on the shapes of the models
it serves (each wrapper in engine/kernels/gpu called as the engine calls it, with tensors of the
model's dims) and, in place of each launch, compiles that kernel with its constants and launch
options for sm_90 (Triton's own compiler and ptxas, no driver needed), then reads back the
program's shared memory (Triton's figure) and what ptxas's log says of it: registers a thread,
stack frame, bytes spilled.

The figures are this Triton's (the project's venv); a GPU image with another Triton version
may lay out shared memory differently. tests/engine/test_sm90_build.py runs this in a process
of its own (the tests' process imports Triton for its interpreter) and checks the limits.

    python -m tests.sm90_build [--models NAME ...] [--model-dir FOLDER ...] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# cudaDevAttrMaxSharedMemoryPerBlockOptin on compute capability 9.0 (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"): 227 KB of a multiprocessor's 228
SM90_SHARED_PER_BLOCK = 227 * 1024

# Real models' shapes (Hugging Face config fields; parsed by the engine's own ModelConfig), chosen
# so that every launch parameter the kernels derive from a shape takes the values production
# models give it: head dims 64 and 128 and MLA's 512 + 64, GQA groups of 4 and 8 rows and MQA's
# 32, Qwen3's q/k norms, softmax-routed MoE from 8 to 128 experts and DeepSeek-V3's 256
# sigmoid-routed ones (their router is torch's; their experts are the Triton kernels).
_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
               rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072)
MODELS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "llama-3.1-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    "llama-mqa": dict(_LLAMA3, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=1),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                         vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128),
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                             vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             moe_intermediate_size=1408, n_routed_experts=64,
                             n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                             moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
                             norm_topk_prob=False, scoring_func="softmax"),
    "deepseek-v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=2048,
                        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                        first_k_dense_replace=3, moe_layer_freq=1, topk_method="noaux_tc",
                        n_group=8, topk_group=4, norm_topk_prob=True, scoring_func="sigmoid",
                        routed_scaling_factor=2.5),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Every model is served in bfloat16; float32 (the parity tests' dtype, whose IEEE products take
# the most registers and the slowest builds) on one model of each kind of launch.
FLOAT32_MODELS = ("llama-3.2-1b", "llama-3.1-8b", "mixtral-8x7b", "qwen3-30b-a3b",
                  "deepseek-v2-lite")
BLOCK_SIZE = 16  # the engine's default KV block
DECODE_BATCHES = (1, 64)  # a lone sequence splits its context; 64 fill the GPU without splits
PREFILL_TOKENS = 512  # two chunks
SM90_MULTIPROCESSORS = 132  # an H100 SXM's and an H200's (decode_splits reads it)


@dataclass(frozen=True)
class Build:
    """One kernel as the engine launches it on one model's shape, built for sm_90."""

    model: str
    dtype: str
    launch: str  # the engine's call that launched it
    kernel: str
    constants: dict[str, Any]
    num_warps: int
    num_stages: int
    shared: int  # bytes of shared memory a block takes (Triton's figure: static + dynamic)
    registers: int  # a thread's
    spill_stores: int  # bytes of registers a thread spills to local memory
    spill_loads: int
    stack: int  # bytes of a thread's stack frame
    seconds: float


def _kernel_modules():
    from pdcluster.engine.kernels.gpu import (
        decode_attention,
        fused_moe,
        layer_ops,
        prefill_attention,
    )

    return decode_attention, prefill_attention, layer_ops, fused_moe


def launched_kernels() -> dict[str, Any]:
    """Every kernel the wrappers launch (`@triton.jit` functions named `*_kernel`; the others
    are helpers inlined into them)."""
    import triton

    return {name: obj for module in _kernel_modules() for name, obj in vars(module).items()
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel")}


class _Sm90Driver:
    """What Triton's JIT asks its active driver while it compiles: the target, a device and a
    stream (it launches nothing here: every launch is a warm-up)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


Launch = tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _launches(model: str, dtype: torch.dtype) -> Iterator[Launch]:
    """(what, wrapper, args, kwargs) for each wrapper call the engine makes on `model`'s shape
    (one of MODELS, or a model folder). Tensors are of the engine's shapes and index dtypes,
    on torch's meta device (no memory): nothing runs."""
    decode, prefill, layer_ops, fused_moe = _kernel_modules()
    cfg = _config(model)

    def empty(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    blocks, hidden, batches = 64, cfg.hidden_size, DECODE_BATCHES
    tables = {batch: empty(batch, 32, dtype=torch.int32) for batch in (1, 2, *batches)}
    lens = {batch: empty(batch, dtype=torch.int64) for batch in (1, *batches)}
    norms = {hidden}
    if cfg.mla is not None:
        mla = cfg.mla
        norms |= {mla.kv_lora_rank} | ({mla.q_lora_rank} if mla.q_lora_rank else set())
        cache = empty(blocks, BLOCK_SIZE, 1, mla.kv_lora_rank + mla.qk_rope_head_dim)
        for batch in batches:
            # MLA's absorbed decode (models/mla.py): every head a row of the one latent head
            queries = empty(batch, 1, cfg.num_heads, cache.shape[-1])
            yield (f"MLA decode x{batch}", decode.paged_attention,
                   (queries, cache, cache[..., : mla.kv_lora_rank], tables[batch], lens[batch],
                    0.1), {})
    else:
        kv_heads, dim, group = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
        k_cache = empty(blocks, BLOCK_SIZE, kv_heads, dim)
        v_cache = empty(blocks, BLOCK_SIZE, kv_heads, dim)
        for batch in batches:
            yield (f"decode x{batch}", decode.paged_attention,
                   (empty(batch, kv_heads, group, dim), k_cache, v_cache, tables[batch],
                    lens[batch], 0.1), {})
        # the shared-prefix cascade: every sequence's rows against the shared blocks at once
        yield ("cascade", decode.paged_attention,
               (empty(1, kv_heads, group * max(batches), dim), k_cache, v_cache, tables[1],
                lens[1], 0.1), {})
        q = empty(PREFILL_TOKENS, cfg.num_heads, dim)
        yield ("prefill of two chunks", prefill.prefill_attention,
               (q, k_cache, v_cache, empty(*q.shape), tables[2], empty(3, dtype=torch.int32),
                empty(2, dtype=torch.int32), PREFILL_TOKENS // 2, 0.1), {})
        positions = empty(PREFILL_TOKENS, dtype=torch.int64)
        rope = empty(4096, dim)
        yield ("RoPE and the cache write", layer_ops.rope_and_cache_,
               (empty(PREFILL_TOKENS, (cfg.num_heads + 2 * kv_heads) * dim), positions, rope,
                rope, cfg.num_heads, kv_heads, empty(blocks * BLOCK_SIZE * 2 * kv_heads, dim),
                positions, 0, BLOCK_SIZE, 2 * BLOCK_SIZE),
               {"qk_norm": (empty(dim), empty(dim)) if cfg.qk_norm else None, "eps": 1e-6})
    for size in sorted(norms):
        yield (f"RMSNorm {size}", layer_ops.rms_norm, (empty(8, size), empty(size), 1e-6), {})
        yield (f"RMSNorm {size} with the residual", layer_ops.add_rms_norm_,
               (empty(8, size), empty(8, size), empty(size), 1e-6), {})
    moe = cfg.moe
    intermediates = {cfg.intermediate_size}
    if moe is not None:
        intermediates.add(moe.intermediate_size)
        if moe.scoring == "softmax" and moe.num_groups == 1 and not moe.score_bias:
            yield ("router", fused_moe.route_softmax_topk,
                   (empty(8, hidden), empty(moe.num_experts, hidden), moe.top_k,
                    moe.norm_topk_prob, 1.0), {})
        w13 = empty(moe.num_experts, 2 * moe.intermediate_size, hidden)
        w2 = empty(moe.num_experts, hidden, moe.intermediate_size)
        for tokens in (8, PREFILL_TOKENS):  # a decode batch's few pairs, a prefill's many
            yield (f"experts x{tokens}", fused_moe.moe_experts,
                   (empty(tokens, hidden), empty(tokens, moe.top_k, dtype=torch.int64),
                    empty(tokens, moe.top_k), w13, w2, 0), {})
    for size in sorted(intermediates):
        yield (f"SwiGLU {size}", layer_ops.silu_and_mul, (empty(8, 2 * size), size), {})


def _ptxas_figures(log: str, kernel: str) -> dict[str, int]:
    """What ptxas -v said of `kernel`'s build: registers a thread, its stack frame, bytes of
    registers spilled to local memory and read back."""
    found = re.search(rf"Function properties for {kernel}\s+(\d+) bytes stack frame, "
                      r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    used = re.search(rf"Compiling entry function '{kernel}'.*?Used (\d+) registers", log, re.S)
    assert found and used, f"no figures for {kernel} in ptxas's log:\n{log}"
    return {"stack": int(found[1]), "spill_stores": int(found[2]), "spill_loads": int(found[3]),
            "registers": int(used[1])}


def cases(models: list[str] | None = None, model_dirs: tuple[str, ...] = ()
          ) -> list[tuple[str, str]]:
    """(model, dtype) pairs: every one of MODELS (or `models`) in bfloat16, FLOAT32_MODELS in
    float32 too, and the model folders `model_dirs` in both."""
    named = MODELS if models is None else models
    return ([(m, "bfloat16") for m in named] + [(m, "float32") for m in named
                                               if m in FLOAT32_MODELS]
            + [(folder, dtype) for folder in model_dirs for dtype in DTYPES])


def _config(model: str):
    """A model's ModelConfig: one of MODELS, or a model folder's config.json."""
    from pdcluster.engine.models.model_config import ModelConfig

    return (ModelConfig.from_hf(MODELS[model]) if model in MODELS
            else ModelConfig.from_pretrained(model))


def build_all(pairs: list[tuple[str, str]]) -> list[Build]:
    """Every distinct build the engine's launches on these (model, dtype) pairs take, for
    sm_90."""
    builds: dict[str, Build] = {}
    current: dict[str, str] = {}

    def compile_only(name, launch):
        def run(*args, grid, warmup, **kwargs):
            started = time.perf_counter()
            log = io.StringIO()
            with contextlib.redirect_stdout(log):  # where Triton prints ptxas's log
                kernel = launch(*args, grid=grid, warmup=True, **kwargs)
            meta = kernel.metadata
            if meta.hash not in builds:
                builds[meta.hash] = Build(
                    model=current["model"], dtype=current["dtype"],
                    launch=current["launch"], kernel=name,
                    constants={k: v for k, v in kwargs.items() if k.isupper()},
                    num_warps=meta.num_warps, num_stages=meta.num_stages, shared=meta.shared,
                    seconds=round(time.perf_counter() - started, 2),
                    **_ptxas_figures(log.getvalue(), name))
            return kernel
        return run

    with _as_on_sm90(compile_only):
        for model, dtype in pairs:
            current.update(model=model if model in MODELS else Path(model).name, dtype=dtype)
            for what, wrapper, args, kwargs in _launches(model, DTYPES[dtype]):
                current["launch"] = what
                wrapper(*args, **kwargs)
    return list(builds.values())


@contextlib.contextmanager
def _as_on_sm90(compile_only) -> Iterator[None]:
    """Launches become builds for sm_90, from scratch (a cached build runs no ptxas, whose
    log holds the figures), with the launch settings a GPU gets: its multiprocessor count
    for the split counts, and the tiles the wrappers give CUDA tensors (small ones
    otherwise, for Triton's interpreter)."""
    from triton import knobs
    from triton.runtime.driver import driver

    decode, prefill, _, fused_moe = _kernel_modules()
    kernels = launched_kernels()
    cuda = torch.device("cuda")
    patches = [(kernel, "run", compile_only(name, kernel.run)) for name, kernel in kernels.items()]
    patches += [
        (decode, "num_sms", lambda device: SM90_MULTIPROCESSORS),
        (prefill, "_prefill_tiles",
         lambda dim, dtype, device, tiles=prefill._prefill_tiles: tiles(dim, dtype, cuda)),
        (fused_moe, "_tiles",
         lambda pairs, dtype, device, tiles=fused_moe._tiles: tiles(pairs, dtype, cuda)),
        (driver, "_active", _Sm90Driver()),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope():
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        try:
            for owner, attr, value in patches:
                setattr(owner, attr, value)
            for kernel in kernels.values():
                kernel.device_caches.clear()  # builds made for another target, or cached
            yield
        finally:
            for owner, attr, value in saved:
                setattr(owner, attr, value)
            for kernel in kernels.values():
                kernel.device_caches.clear()  # sm_90's builds are no launch's here


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", choices=sorted(MODELS), default=None,
                        help="these of MODELS only (none: only --model-dir's)")
    parser.add_argument("--model-dir", action="append", default=[],
                        help="a model folder to build for as well (repeatable)")
    parser.add_argument("--shard", default="0/1", metavar="K/N",
                        help="build only every N-th (model, dtype) pair from the K-th")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    shard, shards = (int(part) for part in args.shard.split("/"))
    builds = build_all(cases(args.models, tuple(args.model_dir))[shard::shards])
    for b in sorted(builds, key=lambda b: (b.kernel, b.dtype, b.model)):
        print(f"{b.kernel:22} {b.model:16} {b.dtype:8} {b.launch:26} {b.num_warps} warps"
              f" {b.num_stages} stages {b.shared / 1024:6.1f} KB shared {b.registers:3} regs"
              f" {b.spill_stores:5} B spilled {b.seconds:4.1f} s {b.constants}")
    if args.json:
        import triton

        print(json.dumps({"target": "sm_90", "triton": triton.__version__,
                          "kernels": sorted(launched_kernels()),
                          "builds": [asdict(b) for b in builds]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
