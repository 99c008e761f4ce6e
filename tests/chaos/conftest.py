"""Chaos test fixtures: one small served cluster per module (benchmarks/chaos_cluster.py: 2
prefill + 2 decode node actors on a local Ray, the metadata service and the router as real
processes, the tiny llama-gqa model) that every fault of the module breaks in turn, and a
helper that runs one of the benchmark's faults under a small load on it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from benchmarks.chaos_bench import fault_load, run_abort_storm, run_fault, wait_ready
from benchmarks.chaos_cluster import ChaosCluster, ChaosSettings
from benchmarks.chaos_load import LoadSpec
from benchmarks.chaos_soak import run_soak

MODEL = "llama-gqa"
# small: a few seconds of load around each fault (rate x count), 8 tokens out
BASE_LOAD = LoadSpec(rate=10.0, count=24, max_tokens=8)


class Chaos:
    def __init__(self, cluster: ChaosCluster, model_dir: str) -> None:
        self.cluster = cluster
        self.model_name = Path(model_dir).name
        self.vocab_size = int(json.loads((Path(model_dir) / "config.json").read_text())
                              ["vocab_size"])

    def fault(self, name: str, base: LoadSpec = BASE_LOAD) -> dict:
        spec, at_s = fault_load(base, name, self.cluster.settings.lease_ttl_s)
        return asyncio.run(run_fault(self.cluster, name, spec, self.model_name,
                                     self.vocab_size, at_s))

    def abort_storm(self, spec: LoadSpec) -> dict:
        return asyncio.run(run_abort_storm(self.cluster, spec, self.model_name,
                                           self.vocab_size))

    def soak(self, spec: LoadSpec) -> dict:
        async def soak() -> dict:
            await wait_ready(self.cluster)
            return await run_soak(self.cluster, spec, self.model_name, self.vocab_size)

        return asyncio.run(soak())


def assert_load_sent_and_completed(result: dict, name: str, lease_ttl_s: int,
                                   base: LoadSpec = BASE_LOAD) -> None:
    """Fault `name`'s whole load was sent and every request of it completed, some of them while
    the fault lasted: a fault run that sent nothing, or finished before the fault, proves
    nothing."""
    spec, _ = fault_load(base, name, lease_ttl_s)
    assert result["sent"] >= spec.count > 0, result
    assert result["completed"] == result["sent"], result["failed_by_cause"]
    assert result["latency"]["during"]["n"] > 0, result["latency"]
    assert result["latency"]["after"]["n"] > 0, result["latency"]


def start_chaos(model_dirs, model_name: str = MODEL, **settings) -> Chaos:
    model = model_dirs[model_name]
    cluster = ChaosCluster(ChaosSettings(model=model, **{"kv_blocks": 256, **settings}))
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return Chaos(cluster, model)
