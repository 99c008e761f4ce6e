"""Chaos benchmark: `python -m benchmarks chaos [--json]` — faults under load, where nothing may
be lost.

A served cluster (benchmarks/chaos_cluster.py: a local Ray with prefill and decode node
actors, the metadata service and the router each a real process, the tiny random model by
default or `--model`) under a bounded open-loop load (benchmarks/chaos_load.py: fixed rate
and count, streaming and not, shared prefixes). One fault at a time while the load runs
(benchmarks/chaos_faults.py; the abort storm is a load whose clients walk away, the soak a
load of unique prompts). Per fault: requests sent / completed / failed (by HTTP status and
cause) / truncated, p50 and p99 latency before, during and after (the *before* phase is the
baseline, measured in the same run), time to recover (and for the requests in flight at the
fault: when the last of them finished, and when the last streamed one still waiting for its
first token got it — a decode node whose prefill node died resumes there), KV blocks leaked
on every node once the load drained, and whether the global index (the metadata service's and
the router's mirror) equals the nodes' caches within a lease TTL once the load drained and
every node is back (`index_exact_after_s`; benchmarks/chaos_checks.py).

API: `run(args)`, `run_fault` (`fault_outcomes`: with each request's outcome),
`run_abort_storm`, `wait_ready`, `goals`, `inflight_figures`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.chaos_checks import IndexCheck, drain_and_count_leaks, total_leaked
from benchmarks.chaos_cluster import ChaosCluster, ChaosSettings
from benchmarks.chaos_faults import (
    FAULTS,
    LINK_FAULTS,
    FaultRun,
    fault_seconds,
    router_health,
)
from benchmarks.chaos_load import LoadSpec, run_load
from benchmarks.chaos_netns import in_private_netns, run_in_private_netns
from benchmarks.chaos_soak import run_soak
from benchmarks.chaos_stats import summarize
from pdcluster.cluster.cli_common import UsageError

_ROUTER_COUNTERS = ("router_prefill_lost_total", "router_migrations_total",
                    "router_aborts_total")
# A decode node whose prefill node died resumes its waiting requests this soon after the kill
# (told by the router, it recomputes them; never by waiting out its KV timeout).
RESUME_GOAL_S = 1.0


async def wait_ready(cluster: ChaosCluster, timeout_s: float | None = None) -> None:
    """Until the router sees every node healthy and follows the metadata service's index
    (at most `timeout_s`, by default as long as a node may take to restart)."""
    timeout_s = timeout_s or cluster.settings.node_start_s
    deadline = time.monotonic() + timeout_s
    expected = len(cluster.actors)
    while True:
        try:
            health = await router_health(cluster)
            healthy = sum(n["healthy"] for n in health["nodes"].values())
            if healthy == expected and (health.get("metadata") or {}).get("mirror_in_sync"):
                return
        except OSError:
            health = {}
        if time.monotonic() > deadline:
            raise RuntimeError(f"cluster not ready after {timeout_s} s: {health}")
        await asyncio.sleep(0.1)


async def _router_counters(cluster: ChaosCluster) -> dict[str, float]:
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, \
            session.get(f"{cluster.router_url}/metrics") as reply:
        text = await reply.text()
    out = dict.fromkeys(_ROUTER_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
            elif (sample.name == "router_routing_decisions_total"
                  and sample.labels.get("role") == "decode"):  # one per request placed
                name = f"decisions_{sample.labels['reason']}"
                out[name] = out.get(name, 0.0) + sample.value
    return out


def _decode_transfer_counters(cluster: ChaosCluster) -> dict[str, int]:
    import ray

    totals = {"recvs_ok": 0, "recvs_failed": 0, "timeouts": 0, "sources_lost": 0}
    # a vLLM node reports none before its first transfer (its stat logger has not run yet)
    for node_id, actor in cluster.actors.items():
        try:
            stats = ray.get(actor.transfer_stats.remote(), timeout=30)
        except Exception:  # restarting: its counters start again from 0
            continue
        for name in totals:
            totals[name] += stats.get(name, 0) if node_id.startswith("d") else 0
    return totals


def _moved(before: dict, after: dict) -> dict:
    # a restarted node counts from 0 again: never report a negative change
    return {k: (after[k] - before.get(k, 0)) if after[k] >= before.get(k, 0) else after[k]
            for k in after}


async def _measured(cluster: ChaosCluster, spec: LoadSpec, model: str, vocab_size: int,
                    run: FaultRun | None, fault) -> tuple[list, dict]:
    """The load (with the fault beside it); then drain, leaks, index. Returns the outcomes
    and the figures measured after the load."""
    ttl = cluster.settings.lease_ttl_s
    check = IndexCheck(cluster)
    counters = await _router_counters(cluster)
    transfers = await asyncio.to_thread(_decode_transfer_counters, cluster)
    try:
        outcomes = await run_load(cluster.router_url, model, spec, vocab_size,
                                  on_start=None if fault is None else
                                  (lambda t0: fault(run, t0)))
        drained_at = max(o.done for o in outcomes)
        leaks = await asyncio.to_thread(drain_and_count_leaks, cluster)
        await wait_ready(cluster)
        exact_s, problems = await check.until_exact(3 * ttl)
    finally:
        await check.close()
    after: dict[str, Any] = {"leaked_blocks": total_leaked(leaks), "leaks_per_node": leaks,
             "index_exact_after_s": exact_s, "index_exact_within_ttl":
             exact_s is not None and exact_s <= ttl, "drained_at_s": round(drained_at, 3),
             "router": _moved(counters, await _router_counters(cluster)),
             "decode_transfers": _moved(transfers, await asyncio.to_thread(
                 _decode_transfer_counters, cluster))}
    if problems:
        after["index_problems"] = problems[:5]
    return outcomes, after


def fault_load(base: LoadSpec, name: str, lease_ttl_s: int) -> tuple[LoadSpec, float]:
    """The load for fault `name` and when the fault begins on its clock: a quarter of `base`
    before it (the baseline), then long enough for the fault itself and half of `base` after;
    a fault that outlasts its estimate gets that half after it all the same. Its prompts are
    its own (seeded by the fault): a load repeating an earlier fault's prompts would find them
    cached on the decode nodes and move no KV at all."""
    at_s = base.duration_s / 4
    need_s = at_s + fault_seconds(name, lease_ttl_s) + base.duration_s / 2
    count = max(base.count, int(need_s * base.rate))
    seed = base.seed + zlib.crc32(name.encode())
    return replace(base, count=count, seed=seed, after_side_s=base.duration_s / 2), at_s


async def run_fault(cluster: ChaosCluster, name: str, spec: LoadSpec, model: str,
                    vocab_size: int, at_s: float) -> dict:
    """One fault `at_s` seconds into the load; its figures."""
    return (await fault_outcomes(cluster, name, spec, model, vocab_size, at_s))[0]


async def fault_outcomes(cluster: ChaosCluster, name: str, spec: LoadSpec, model: str,
                         vocab_size: int, at_s: float) -> tuple[dict, list]:
    """`run_fault`'s figures, and the outcome of every request of its load."""
    await wait_ready(cluster)
    run = FaultRun(cluster, at_s=at_s)
    outcomes, after = await _measured(cluster, spec, model, vocab_size, run, FAULTS[name])
    result = {"fault_start_s": round(run.start, 3), "fault_end_s": round(run.end, 3),
              **summarize(outcomes, run.start, run.end), **after, **run.extra}
    result.update(inflight_figures(outcomes, run.start))
    return result, outcomes


def inflight_figures(outcomes: list, start: float) -> dict:
    """The requests in flight at the fault: how many; when the last finished; and of the
    streamed ones with no token yet, how many and when the last got its first token, from
    the fault's start (None: no such request)."""
    inflight = [o for o in outcomes if o.ok and o.sent < start < o.done]
    waiting = [o.first_token for o in inflight
               if o.first_token is not None and o.first_token > start]
    return {"inflight_at_fault": len(inflight),
            "inflight_done_after_fault_s_max": (
                round(max(o.done for o in inflight) - start, 3) if inflight else None),
            "inflight_waiting_at_fault": len(waiting),
            "inflight_resumed_after_fault_s_max": (
                round(max(waiting) - start, 3) if waiting else None)}


async def run_abort_storm(cluster: ChaosCluster, spec: LoadSpec, model: str,
                          vocab_size: int) -> dict:
    """A load whose clients walk away from `spec.abort_share` of the requests, timed to land
    while their KV moves; then how soon every node is idle with all its blocks free."""
    await wait_ready(cluster)
    outcomes, after = await _measured(cluster, spec, model, vocab_size, None, None)
    aborted = [o.done for o in outcomes if o.aborted]
    idle = [f["idle_after_s"] for f in after["leaks_per_node"].values()]
    result = {**summarize(outcomes, 0.0, spec.duration_s), **after}
    # from the moment the last client left or was answered to every node idle, all blocks free
    result["idle_after_drain_s"] = None if None in idle else max(idle)
    result["last_abort_before_drain_s"] = (round(after["drained_at_s"] - max(aborted), 3)
                                           if aborted else None)
    return result


def _settings(args: argparse.Namespace, model: str) -> ChaosSettings:
    return ChaosSettings(model=model, num_prefill=args.num_prefill,
                         num_decode=args.num_decode, backend=args.backend,
                         lease_ttl_s=args.lease_ttl, kv_blocks=args.kv_blocks,
                         engine=args.engine)


def _specs(args: argparse.Namespace) -> dict[str, LoadSpec]:
    scale = 0.25 if args.quick else 1.0
    count = max(8, int(args.requests * scale))
    return {
        "fault": LoadSpec(rate=args.rate, count=count, max_tokens=args.max_tokens),
        "storm": LoadSpec(rate=4 * args.rate, count=max(16, int(args.storm_requests * scale)),
                          max_tokens=args.max_tokens, abort_after_s=(0.005, 0.25),
                          abort_share=0.75, seed=7),
        "soak": LoadSpec(rate=args.rate, count=max(16, int(args.soak_s * scale * args.rate)),
                         max_tokens=4, unique=True, seed=11)}


async def _run_all(cluster: ChaosCluster, args: argparse.Namespace, model_name: str,
                   vocab_size: int) -> dict:
    await wait_ready(cluster)
    specs = _specs(args)
    # open every prefill -> decode connection once, so no fault's baseline pays for it
    await run_load(cluster.router_url, model_name, LoadSpec(rate=8, count=16, seed=99),
                   vocab_size)
    faults: dict[str, dict] = {}
    for name in args.faults.split(","):
        if name == "abort_storm":
            faults[name] = await run_abort_storm(cluster, specs["storm"], model_name, vocab_size)
        elif name != "soak":
            spec, at_s = fault_load(specs["fault"], name, args.lease_ttl)
            faults[name] = await run_fault(cluster, name, spec, model_name, vocab_size, at_s)
    soak = None
    if args.soak_s > 0:
        await wait_ready(cluster)
        soak = await run_soak(cluster, specs["soak"], model_name, vocab_size)
    return {"faults": faults, "soak": soak}


def run(args: argparse.Namespace) -> dict:
    names = args.faults.split(",")
    unknown = set(names) - set(FAULTS) - {"abort_storm"}
    if unknown:
        raise UsageError(f"unknown faults {sorted(unknown)}: pick from "
                         f"{sorted(FAULTS) + ['abort_storm']}")
    if "etcd_restart" in names and args.backend != "etcd":
        raise UsageError("the etcd_restart fault needs --backend etcd")
    if args.engine == "vllm":
        _check_vllm()
    if set(names) & set(LINK_FAULTS) and not in_private_netns():
        # the whole run moves into a network namespace of its own, where it may drop packets
        return run_in_private_netns(["chaos", "--json", *_cli_args(args)],
                                    timeout_s=6 * 3600)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pdcluster-chaos-bench-") as tmp:
        model = args.model or _tiny_model(tmp, args.engine)
        vocab_size = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
        cluster = ChaosCluster(_settings(args, model))
        try:
            cluster.start()
            measured = asyncio.run(_run_all(cluster, args, Path(model).name, vocab_size))
        finally:
            cluster.stop()
    measured["left_running_after_stop"] = cluster.left_running
    return {"model": Path(model).name if args.model else "tiny (random weights)",
            "engine": args.engine, "num_prefill": args.num_prefill,
            "num_decode": args.num_decode, "backend": args.backend,
            "lease_ttl_s": args.lease_ttl, "rate": args.rate,
            **measured, "goals": goals(measured, args.lease_ttl, cluster.settings.kv_timeout_s),
            "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)},
            "wall_s": round(time.perf_counter() - started, 1)}


def _cli_args(args: argparse.Namespace) -> list[str]:
    """`args` as `python -m benchmarks chaos` options again (for the run in a network namespace)."""
    out = ["--faults", args.faults, "--engine", args.engine,
           "--num-prefill", str(args.num_prefill),
           "--num-decode", str(args.num_decode), "--backend", args.backend,
           "--lease-ttl", str(args.lease_ttl), "--kv-blocks", str(args.kv_blocks),
           "--rate", str(args.rate), "--requests", str(args.requests),
           "--storm-requests", str(args.storm_requests), "--max-tokens", str(args.max_tokens),
           "--soak-s", str(args.soak_s)]
    return out + (["--model", args.model] if args.model else []) + (
        ["--quick"] if args.quick else [])


def goals(measured: dict, lease_ttl_s: int, kv_timeout_s: float = 30.0) -> dict[str, bool]:
    """Each fault's goals, as booleans: nothing lost (decode_kill: only the
    streams its dead node had sent), nothing leaked, the index exact within a TTL, no child
    process of a killed node outliving it, nothing running after the cluster stopped, and per
    fault: no decode waited out its KV timeout — none counted, every request in flight done
    sooner (a vLLM node's counters may lag) and the waiting ones resumed within
    `RESUME_GOAL_S` (prefill_kill) —, every node idle within 1 s (abort_storm), no live
    node's blocks erased and routing prefix-aware (metadata_stall)."""
    out = {}
    for name, f in measured["faults"].items():
        lost_ok = f["failed"] == 0 or (name == "decode_kill"
                                       and f["failed"] <= f.get("inflight_at_kill", 0))
        met = lost_ok and f["leaked_blocks"] == 0 and f["index_exact_within_ttl"]
        met = met and not f.get("orphans_killed")  # a killed node's children went with it
        if name == "prefill_kill":
            met = met and f["decode_transfers"]["timeouts"] == 0 and _resumed(f, kv_timeout_s)
        elif name == "abort_storm":
            met = met and f["idle_after_drain_s"] is not None and f["idle_after_drain_s"] <= 1
        elif name == "metadata_stall":
            met = (met and not f["nodes_erased_from_router_index"]
                   and f["prefix_aware_share_during"] == 1.0)
        out[name] = bool(met)
    if measured.get("soak"):
        out["soak"] = bool(measured["soak"]["memory_flat"] and not measured["soak"]["failed"])
    if "left_running_after_stop" in measured:
        out["nothing_left_running"] = not measured["left_running_after_stop"]
    return out


def _resumed(fault: dict, kv_timeout_s: float) -> bool:
    done = fault.get("inflight_done_after_fault_s_max")
    resumed = fault.get("inflight_resumed_after_fault_s_max")
    return ((done is None or done < kv_timeout_s)
            and (resumed is None or resumed <= RESUME_GOAL_S))


def _tiny_model(tmp: str, engine: str) -> str:
    from pdcluster.engine.models.tiny_model import make_tiny_model

    if engine == "vllm":  # vLLM's CPU attention kernels take head sizes of 32 and up
        return str(make_tiny_model(Path(tmp) / "tiny", preset="tiny", hidden_size=128,
                                   num_attention_heads=4, num_key_value_heads=2))
    return str(make_tiny_model(Path(tmp) / "tiny", preset="tiny"))


def _check_vllm() -> None:
    """--engine vllm needs vLLM installed (its nodes would fail one by one otherwise)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError("--engine vllm needs vLLM (`make setup-vllm`)")
