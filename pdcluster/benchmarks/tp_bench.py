"""Tensor parallelism's cost and gain on this machine: `pdcluster bench tp [--json] [--quick]
[--device D] [--tensor-parallel-size N]`.

On one random model (the `bench` preset of engine.models.tiny_model: hidden 512, 8 layers,
8 heads / 4 KV heads, 32k vocabulary; float32 on CPU, bfloat16 on CUDA) measures, in one run,
the engine at TP=1 and at TP=N (default 2) on the same prompts (greedy, EOS ignored):

- batch-1 decode step (median `LLMEngine.step`),
- a batch-16 decode step,
- TTFT of a 512-token prompt (median of 3),

and reports each TP=N figure over TP=1's, and whether their greedy tokens are equal. On a CPU
both runs share the same cores (TP=1 with all of them, each of N ranks with 1/N), so the ratio
shows what the per-layer collectives cost where no extra compute comes with the ranks; on GPUs
each rank brings its own device. The machine's ceiling for that cost, in the same run:
`allreduce_us_p50` / `_mean`, the time of one all-reduce of a decode step's activations (one token's
hidden state) between N processes joined as the engine joins its ranks
(`runner.tp_workers.make_group`: gloo on CPU, NCCL on CUDA).

Returns a flat dict; the CLI prints it as the last line of stdout.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

_BENCH_HIDDEN = 512  # the `bench` preset's hidden size
_ALLREDUCE_WARMUP, _ALLREDUCE_TIMED = 20, 200


def _engine(model: str, device: str, tp: int):
    from pdcluster.engine import LLM

    dtype = "float32" if device == "cpu" else "bfloat16"
    return LLM(model, device=device, dtype=dtype, num_kv_blocks=512, max_num_seqs=32,
               tensor_parallel_size=tp)


def _prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(n)]


def _decode_step(llm, batch: int, steps: int, rng: random.Random) -> float:
    from pdcluster.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i, prompt in enumerate(_prompts(batch, 64, rng)):
        engine.add_request(f"decode-{batch}-{i}", prompt, params)
    engine.step()  # the prefills
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _ttft(llm, length: int, repeats: int, rng: random.Random) -> float:
    from pdcluster.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for prompt in _prompts(repeats, length, rng):
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(model: str, device: str, tp: int, quick: bool) -> tuple[dict, list[list[int]]]:
    from pdcluster.engine import SamplingParams

    rng = random.Random(0)  # the same prompts at every TP size
    llm = _engine(model, device, tp)
    try:
        steps = 8 if quick else 32
        figures = {"decode_b1_ms": _decode_step(llm, 1, steps, rng) * 1e3,
                   "decode_b16_ms": _decode_step(llm, 16, steps, rng) * 1e3,
                   "ttft_512_ms": _ttft(llm, 512, 2 if quick else 3, rng) * 1e3}
        tokens = [o.token_ids for o in llm.generate(
            _prompts(4, 40, rng), SamplingParams(temperature=0.0, max_tokens=8,
                                                 ignore_eos=True))]
    finally:
        llm.engine.close()
    return figures, tokens


def _allreduce_rank(rank: int, size: int, store: str, device: str, hidden: int,
                    results) -> None:
    import torch

    from pdcluster.engine.runner.tp_workers import make_group, rank_device

    where = rank_device(device, rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    else:
        torch.set_num_threads(1)
    tp = make_group(rank, size, store, where)
    x = torch.ones(1, hidden, device=where)
    times = []
    for i in range(_ALLREDUCE_WARMUP + _ALLREDUCE_TIMED):
        start = time.perf_counter()
        tp.all_reduce(x)
        if where.type == "cuda":
            torch.cuda.synchronize()
        if i >= _ALLREDUCE_WARMUP:
            times.append(time.perf_counter() - start)
    if rank == 0:
        results.put((statistics.median(times), statistics.fmean(times)))


def _allreduce_us(size: int, device: str, hidden: int) -> tuple[float, float]:
    """Median and mean µs of one all-reduce of `hidden` values between `size` fresh
    processes."""
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pdcluster-tp-allreduce-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_allreduce_rank,
                             args=(rank, size, store, device, hidden, results))
                 for rank in range(size)]
        for p in procs:
            p.start()
        try:
            p50, mean = results.get(timeout=120)
            return p50 * 1e6, mean * 1e6
        finally:
            for p in procs:
                p.join(30)


def run(args: argparse.Namespace) -> dict:
    from pdcluster.engine.models.tiny_model import make_tiny_model

    device, size = args.device or "cpu", args.tensor_parallel_size
    if size < 2:
        raise ValueError("--tensor-parallel-size must be at least 2 (TP=1 is the baseline)")
    with tempfile.TemporaryDirectory(prefix="pdcluster-tp-bench-") as tmp:
        model = str(make_tiny_model(tmp, arch="llama", seed=0, preset="bench"))
        one, tokens_one = _measure(model, device, 1, args.quick)
        many, tokens_many = _measure(model, device, size, args.quick)
    result: dict = {"device": device, "tensor_parallel_size": size,
                    "tokens_equal": tokens_one == tokens_many}
    p50, mean = _allreduce_us(size, device, _BENCH_HIDDEN)
    result.update(allreduce_us_p50=round(p50, 1), allreduce_us_mean=round(mean, 1))
    for name, value in one.items():
        result[f"tp1_{name}"] = round(value, 3)
        result[f"tp{size}_{name}"] = round(many[name], 3)
        result[f"tp{size}_over_tp1_{name.removesuffix('_ms')}"] = round(many[name] / value, 3)
    return result
