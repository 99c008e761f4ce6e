"""`pdcluster bench engine --host-tier [--model DIR] [--quick]`: TTFT of prompts re-asked after
the device's KV pool has cycled, with the host tier, with the disk tier, and recomputing, in
the same run (benchmarks/engine_bench.py hands over here).

Three engines on the same model, the same small device pool (`device_blocks`) and the same
settings; one has a host tier large enough for the whole working set, one a host tier as
small as the device pool with a disk tier below it large enough for the rest (so most
re-asked prefixes come back from the disk file), the other neither. The
working set is `4 x device_blocks` blocks of prompts (`num_prompts` random prompts of
`prompt_len` tokens), asked once each (so the device pool cycles: by the end every prompt's
blocks have left it), then asked again with a fresh short tail: the tiered engine loads the
prefix back from the host (or the disk), the other recomputes it. The engines take turns
prompt by prompt (the order rotating), so the machine's noise falls on all. Then each answers
every re-asked prompt with `check_tokens` greedy tokens, which must be identical.

Reported: the median TTFT of the re-asked prompts with the host tier, with the disk tier and
recomputing, their ratios (`host_over_recompute`, the goal: <= 0.3 on CPU;
`disk_over_recompute`), the blocks the tiered engines loaded, demoted and spilled, the tiers'
measured load bandwidth and latency (what a node reports to the router; the disk's include
the page cache, which is where a freshly written file's blocks mostly are), and
`tokens_identical` (all three engines).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

_PROMPT_VOCAB = 32000


@dataclass(frozen=True, slots=True)
class HostTierSizes:
    device_blocks: int = 64
    block_size: int = 16
    prompt_len: int = 512
    tail_len: int = 8
    check_tokens: int = 16

    @property
    def num_prompts(self) -> int:
        """Prompts whose blocks make four device pools."""
        return 4 * self.device_blocks * self.block_size // self.prompt_len


QUICK = HostTierSizes(device_blocks=32, prompt_len=256, check_tokens=8)


def host_tier_fields(model_dir: str, device: str, quick: bool) -> dict:
    from pdcluster.engine import LLM

    sizes = QUICK if quick else HostTierSizes()
    rng = random.Random(26)
    prompts = [_tokens(rng, sizes.prompt_len) for _ in range(sizes.num_prompts)]
    options = dict(device=device, dtype="float32", block_size=sizes.block_size,
                   num_kv_blocks=sizes.device_blocks, max_num_seqs=8,
                   max_num_batched_tokens=2048)
    with tempfile.TemporaryDirectory(prefix="pdcluster-kv-disk-") as disk_dir:
        engines = {
            "host": LLM(model_dir, num_host_blocks=8 * sizes.device_blocks, **options),
            "disk": LLM(model_dir, num_host_blocks=sizes.device_blocks,
                        num_disk_blocks=8 * sizes.device_blocks, disk_cache_dir=disk_dir,
                        **options),
            "recompute": LLM(model_dir, **options)}
        try:
            return _run(sizes, rng, prompts, engines)
        finally:
            for llm in engines.values():
                llm.engine.close()


def _run(sizes: HostTierSizes, rng: random.Random, prompts: list[list[int]],
         engines: dict) -> dict:
    from pdcluster.engine import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1)
    for llm in engines.values():
        llm.generate(_tokens(rng, 32), one)  # warm-up
        for prompt in prompts:  # the working set passes through the device pool once
            llm.generate(prompt, one)
    engines["disk"].engine.host_cache.disk.drain()  # its spills are on disk before re-asking
    again = [prompt + _tokens(rng, sizes.tail_len) for prompt in prompts]
    ttfts: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for i, prompt in enumerate(again):
        for name in names[i % len(names):] + names[:i % len(names)]:
            started = time.perf_counter()
            engines[name].generate(prompt, one)
            ttfts[name].append(time.perf_counter() - started)
    check = SamplingParams(temperature=0.0, max_tokens=sizes.check_tokens, ignore_eos=True)
    answers = {name: [o.token_ids for o in llm.generate(again, check)]
               for name, llm in engines.items()}
    return _fields(sizes, engines["host"].engine, ttfts, answers) | \
        _disk_fields(engines["disk"].engine, ttfts)


def _disk_fields(engine, ttfts: dict[str, list[float]]) -> dict:
    disk_s, recompute_s = statistics.median(ttfts["disk"]), statistics.median(ttfts["recompute"])
    bandwidth, latency = engine.host_cache.disk.loads.fit()
    tiers = engine.tiers
    return {"disk_tier_ttft_ms": round(disk_s * 1e3, 1),
            "disk_over_recompute": round(disk_s / recompute_s, 3),
            "disk_loaded_blocks": tiers.num_disk_loaded,
            "disk_engine_host_loaded_blocks": tiers.num_loaded - tiers.num_disk_loaded,
            "disk_spilled_blocks": tiers.num_spilled,
            "disk_spills_dropped": tiers.num_spills_dropped,
            "disk_load_gb_per_s": round(bandwidth / 1e9, 2),
            "disk_load_latency_us": round(latency * 1e6, 1)}


def _fields(sizes: HostTierSizes, engine, ttfts: dict[str, list[float]],
            answers: dict[str, list[list[int]]]) -> dict:
    host_s, recompute_s = statistics.median(ttfts["host"]), statistics.median(ttfts["recompute"])
    bandwidth, latency = engine.host_cache.loads.fit()
    return {**{f"host_tier_{k}": v for k, v in asdict(sizes).items()},
            "host_tier_num_prompts": sizes.num_prompts,
            "host_tier_ttft_ms": round(host_s * 1e3, 1),
            "recompute_ttft_ms": round(recompute_s * 1e3, 1),
            "host_over_recompute": round(host_s / recompute_s, 3),
            "host_loaded_blocks": engine.tiers.num_loaded,
            "host_demoted_blocks": engine.tiers.num_demoted,
            "host_load_gb_per_s": round(bandwidth / 1e9, 2),
            "host_load_latency_us": round(latency * 1e6, 1),
            "tokens_identical": answers["host"] == answers["recompute"] == answers["disk"]}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, _PROMPT_VOCAB) for _ in range(n)]
