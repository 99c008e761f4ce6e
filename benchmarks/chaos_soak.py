"""The chaos benchmark's churn soak: unique prompts at a steady rate, so every node's prefix
cache fills and then evicts for the whole run (a high rate of stored and removed block
events through the metadata service into the router's mirror), while the resident memory of
the router, the metadata service and every node is sampled once a second.

Memory is flat when each process's mean RSS over the last quarter of the run is within 5%
of its mean over the second quarter (the first quarter is warm-up: caches still filling,
allocators growing to their working size).

API: `run_soak`, `growth`.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from benchmarks.chaos_checks import rss_bytes
from benchmarks.chaos_cluster import ChaosCluster
from benchmarks.chaos_load import LoadSpec, run_load
from benchmarks.chaos_stats import summarize

FLAT_GROWTH = 0.05


def growth(samples: list[tuple[float, dict[str, int]]], duration_s: float) -> dict[str, dict]:
    """Per process: mean RSS (MiB) in the second and last quarter, and their ratio - 1."""
    out = {}
    names = samples[0][1] if samples else {}
    for name in names:
        q2 = [s[name] for t, s in samples if duration_s / 4 <= t < duration_s / 2]
        q4 = [s[name] for t, s in samples if t >= 3 * duration_s / 4]
        if not q2 or not q4:
            continue
        m2, m4 = statistics.mean(q2), statistics.mean(q4)
        out[name] = {"q2_mib": round(m2 / 2**20, 1), "q4_mib": round(m4 / 2**20, 1),
                     "growth": round(m4 / m2 - 1, 4) if m2 else None}
    return out


async def _events_ingested(cluster: ChaosCluster) -> int:
    from pdcluster.core.credentials import SERVICE
    from pdcluster.metadata_service.client import AsyncMetadataClient

    client = AsyncMetadataClient(cluster.metadata_address,
                                 token=cluster.secret.metadata_token(SERVICE), timeout_s=5.0)
    try:
        return int((await client.stats()).events_ingested)
    finally:
        await client.close()


async def run_soak(cluster: ChaosCluster, spec: LoadSpec, model: str, vocab_size: int,
                   interval_s: float = 1.0) -> dict:
    pids = await asyncio.to_thread(cluster.pids)
    samples: list[tuple[float, dict[str, int]]] = []

    async def sample(t0: float) -> None:
        while time.monotonic() - t0 < spec.duration_s:
            samples.append((time.monotonic() - t0, await asyncio.to_thread(rss_bytes, pids)))
            await asyncio.sleep(interval_s)

    events_before = await _events_ingested(cluster)
    outcomes = await run_load(cluster.router_url, model, spec, vocab_size, on_start=sample)
    events = await _events_ingested(cluster) - events_before
    load = summarize(outcomes, spec.duration_s, spec.duration_s)
    rss = growth(samples, spec.duration_s)
    worst = max((f["growth"] for f in rss.values() if f["growth"] is not None), default=None)
    return {"duration_s": round(spec.duration_s, 1), "rate": spec.rate,
            "sent": load["sent"], "completed": load["completed"], "failed": load["failed"],
            "failed_by_cause": load["failed_by_cause"],
            "block_events_per_s": round(events / spec.duration_s, 1),
            "rss": rss, "max_growth": worst,
            "memory_flat": worst is not None and worst < FLAT_GROWTH}
