"""`pdcluster bench vllm [--json] [--quick]`: what pdcluster's cluster layer costs on vLLM nodes,
and what disaggregation does for them, with vLLM's own offline engine as the baseline.

On the real model (SmolLM2-135M-Instruct), the same token ids for everyone:
- throughput of N x (256 -> 64) requests (all sent at once, `ignore_eos`) through the router of
  a `pdcluster serve --engine vllm` cluster (1 prefill + 1 decode node, every prompt through the
  prefill node), divided by vLLM's offline `LLM` generating the same tokens with the same
  total CPU threads; the own engine's cluster on the same workload beside it;
- TTFT of a 2,048-token prompt through the router, disaggregated (the prefill node computes,
  the KV moves over Mooncake) and colocated (the decode node computes: a second router on the
  same cluster whose local-prefill threshold takes every prompt), fresh salts so no prefix
  cache helps either.

Each cluster is a `pdcluster serve` process (local Ray, the metadata service, the router); the
offline baseline runs in a process of its own (vLLM's engine core re-imports the main module).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.vllm_cluster import ServedCluster

VLLM_BLOCK = 32


@dataclass(frozen=True, slots=True)
class Sizes:
    num_requests: int = 32
    prompt_len: int = 256
    output_len: int = 64
    ttft_prompt_len: int = 2048
    ttft_repeats: int = 3


QUICK = Sizes(num_requests=4, prompt_len=64, output_len=8, ttft_prompt_len=256,
              ttft_repeats=1)


def run(args: argparse.Namespace) -> dict:
    from pdcluster.core.paths import builtin_model_dir

    sizes = QUICK if getattr(args, "quick", False) else Sizes()
    model = str(getattr(args, "model", None) or builtin_model_dir())
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(f"no model folder at {model}: pass --model or run make setup")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(sizes.prompt_len)]
               for _ in range(sizes.num_requests)]
    result: dict = {"sizes": asdict(sizes), "model": Path(model).name,
                    "threads": os.cpu_count()}
    offline_s = _offline(model, prompts, sizes.output_len)
    result["vllm_offline_tok_s"] = sizes.num_requests * sizes.output_len / offline_s
    for engine in ("vllm", "pdcluster"):
        with ServedCluster(model, engine) as cluster:
            wall = _throughput(cluster, prompts, sizes.output_len)
            result[f"{engine}_cluster_tok_s"] = sizes.num_requests * sizes.output_len / wall
            if engine == "vllm":
                result.update(_ttfts(cluster, sizes, rng))
    result["cluster_over_offline"] = result["vllm_cluster_tok_s"] / result["vllm_offline_tok_s"]
    result["own_cluster_over_vllm_cluster"] = (result["pdcluster_cluster_tok_s"]
                                               / result["vllm_cluster_tok_s"])
    result["ttft_disagg_over_colocated"] = (result["ttft_disaggregated_s"]
                                            / result["ttft_colocated_s"])
    return result


def _offline(model: str, prompts: list[list[int]], output_len: int) -> float:
    """Seconds vLLM's offline `LLM` takes for the batch (after its warm-up)."""
    with tempfile.TemporaryDirectory(prefix="pdc-vllm-bench-") as tmp:
        job, out = Path(tmp, "job.json"), Path(tmp, "out.json")
        job.write_text(json.dumps({"model": model, "prompts": prompts, "output_len": output_len,
                                   "block_size": VLLM_BLOCK}))
        script = Path(__file__).with_name("vllm_offline.py")
        proc = subprocess.run([sys.executable, str(script), str(job), str(out)], cwd=tmp,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM offline run failed:\n{proc.stderr[-3000:]}")
        return float(json.loads(out.read_text())["seconds"])


def _throughput(cluster: ServedCluster, prompts: list[list[int]], output_len: int) -> float:
    client = cluster.client()
    cluster.warm_up(client)

    def one(i: int) -> int:
        reply = client.completions.create(
            model=cluster.name, prompt=prompts[i], max_tokens=output_len, temperature=0,
            extra_body={"ignore_eos": True, "cache_salt": f"tp-{i}"})
        return reply.usage.completion_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        produced = sum(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - started
    if produced != len(prompts) * output_len:
        raise RuntimeError(f"{produced} tokens produced, {len(prompts) * output_len} asked")
    return wall


def _ttfts(cluster: ServedCluster, sizes: Sizes, rng: random.Random) -> dict:
    """Median TTFT through the cluster's router (every prompt disaggregated) and through a
    second router that lets the decode node compute every prompt itself."""
    with cluster.extra_router(local_prefill_threshold=1 << 30) as colocated:
        times: dict[str, list[float]] = {"disaggregated": [], "colocated": []}
        for i in range(sizes.ttft_repeats):
            prompt = [rng.randrange(100, 40000) for _ in range(sizes.ttft_prompt_len)]
            for name, port in (("disaggregated", cluster.port), ("colocated", colocated)):
                times[name].append(_ttft(cluster.client(port), cluster.name, prompt,
                                         f"ttft-{name}-{i}"))
    return {f"ttft_{name}_s": statistics.median(values) for name, values in times.items()}


def _ttft(client, model: str, prompt: list[int], salt: str) -> float:
    started = time.perf_counter()
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                       temperature=0, stream=True,
                                       extra_body={"cache_salt": salt})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream produced no token")
    return first
