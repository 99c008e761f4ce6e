"""`python -m benchmarks vllm-helpers [--quick]`: vLLM's `torch.compile`d helpers on this CPU,
compiled (vLLM's default) against eager (what a pdcluster vLLM worker runs on the CPU:
pdcluster/vllm_backend/eager.py), in one process.

Two helpers a CPU node meets: the vocabulary-parallel embedding's input mask (every forward
at tensor-parallel size > 1; over 1, 64 and 2,048 tokens) and the logprob ranks (each step
that returns logprobs; over 1 and 64 rows of the built-in model's 49,152-token vocabulary).
Per helper and size: the first call (a compile, unless eager; inductor's cache is a fresh
folder, as on a new host) in seconds and the median of the later calls in milliseconds. The
first calls are what a node's first requests waited for; the later calls are what eager costs
per step.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable

VOCAB = 49_152  # SmolLM2's (the built-in model)


def _timed(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(the first call in s, the median of `calls` later calls in ms)."""
    started = time.perf_counter()
    fn()
    first = time.perf_counter() - started
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return first, statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch._dynamo
    from vllm.model_executor.layers.vocab_parallel_embedding import get_masked_input_and_mask
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    calls = 10 if args.quick else 50
    gen = torch.Generator().manual_seed(0)
    cases: dict[str, Callable[[], object]] = {}
    for n in (1, 64, 2048):
        ids = torch.randint(0, VOCAB, (n,), dtype=torch.int32, generator=gen)
        cases[f"mask_{n}"] = functools.partial(get_masked_input_and_mask, ids, 0, VOCAB // 2,
                                               0, 0, 0)
    for rows in (1, 64):
        logprobs = torch.randn(rows, VOCAB, generator=gen)
        cases[f"rank_{rows}x{VOCAB}"] = functools.partial(
            batched_count_greater_than, logprobs, logprobs[:, :1].clone())
    result: dict[str, float] = {}
    cache = tempfile.TemporaryDirectory(prefix="inductor-")
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    try:
        for mode in ("compiled", "eager"):
            torch._dynamo.reset()
            torch._dynamo.config.disable = mode == "eager"
            for name, fn in cases.items():
                first, median = _timed(fn, calls)
                result[f"{mode}_{name}_first_s"] = round(first, 3)
                result[f"{mode}_{name}_ms"] = round(median, 4)
    finally:
        torch._dynamo.config.disable = False
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
        cache.cleanup()
    for name in cases:
        result[f"eager_over_compiled_{name}"] = round(
            result[f"eager_{name}_ms"] / result[f"compiled_{name}_ms"], 2)
    result["torch_threads"] = torch.get_num_threads()
    return result
