"""`pdcluster replay` (a trace through the routing policy over simulated nodes) and
`pdcluster trace-gen` (write one of the synthetic traces of `router.sim.trace_gen`).

API: `add_replay(subparsers, report)`, `add_trace_gen(subparsers)`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from pdcluster.cluster.cli_common import UsageError, add_command, config_errors_as_usage
from pdcluster.router.sim import trace_gen

REPLAY_POLICIES = ("kv", "round-robin", "least-loaded", "round-robin-pool")
Report = Callable[[Callable[[argparse.Namespace], dict]], Callable[[argparse.Namespace], int]]


def add_replay(subparsers: argparse._SubParsersAction, report: Report) -> None:
    parser = add_command(
        subparsers, "replay",
        "Replay a request trace (JSONL: timestamp, input_length, output_length, hash_ids), or "
        "one of the synthetic traces, through the router's policy over simulated LRU-cache "
        "nodes (a device tier and optionally a host tier below it) feeding the real block "
        "index, with global prefix reuse (pulls) priced as on the live cluster. Reports "
        "hit_ratio, host_hit_ratio, pulled_ratio, work_imbalance, TTFT, ideal_hit_ratio "
        "(infinite memory) and achievable_hit_ratio (one LRU cache of the cluster's memory) "
        "for the chosen policy and for round-robin, least-loaded and round-robin-pool "
        "(round-robin pulling from a shared pool), measured in the same run.",
        lambda args: _cmd_replay(args, report))
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="trace file (JSON lines)")
    source.add_argument("--synthetic", choices=sorted(trace_gen.GENERATORS),
                        help="generate this synthetic trace instead (router/sim/trace_gen.py)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the synthetic trace and of the tie-breaking RNG")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="sessions of the synthetic trace x this, at the same load")
    parser.add_argument("--nodes", type=int, default=8, help="simulated nodes")
    parser.add_argument("--cache-blocks", type=int, default=100_000,
                        help="blocks of cache over all nodes (each node holds C/N)")
    parser.add_argument("--device-blocks", type=int, default=None,
                        help="device blocks per node (instead of --cache-blocks / nodes)")
    parser.add_argument("--host-blocks", type=int, default=0,
                        help="host-tier blocks per node below the device (0: no host tier)")
    parser.add_argument("--host-gbps", type=float, default=40.0,
                        help="bandwidth of a load from the host tier, GB/s")
    parser.add_argument("--host-latency-ms", type=float, default=0.2,
                        help="fixed cost of one load from the host tier, ms")
    parser.add_argument("--policy", choices=REPLAY_POLICIES, default="kv", help="routing policy")
    parser.add_argument("--no-global-reuse", action="store_true",
                        help="nodes never pull a prefix from each other")
    parser.add_argument("--pull-gbps", type=float, default=25.0,
                        help="bandwidth of a prefix pull, GB/s")
    parser.add_argument("--pull-latency-ms", type=float, default=2.0,
                        help="fixed cost of one prefix pull, ms")
    parser.add_argument("--kv-bytes-per-token", type=int, default=131_072,
                        help="KV cache bytes of one token (all layers)")
    _add_planner_args(parser)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def _add_planner_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "planner", "--planner replays the trace over a simulated disaggregated cluster whose "
        "prefill and decode node counts the planner sets (router/sim/planner_replay.py), and "
        "finds the smallest fixed split meeting the SLOs in the same run (best_fixed); "
        "--cache-blocks sizes the cluster's prefix pool")
    group.add_argument("--planner", action="store_true",
                       help="model the planner instead of the routing policies")
    group.add_argument("--max-nodes", type=int, default=16,
                       help="prefill + decode nodes at most (planner and fixed splits)")
    group.add_argument("--slo-ttft-s", type=float, default=2.0, help="TTFT SLO, seconds")
    group.add_argument("--slo-itl-ms", type=float, default=50.0,
                       help="inter-token latency SLO, ms")
    group.add_argument("--startup-s", type=float, default=30.0,
                       help="seconds a started node takes before it serves")
    group.add_argument("--planner-interval-s", type=float, default=10.0,
                       help="seconds between the planner's decisions")


def _cmd_replay(args: argparse.Namespace, report: Report) -> int:
    if args.trace and not Path(args.trace).is_file():
        raise UsageError(f"trace file not found: {args.trace}")
    from pdcluster.router.sim import replay

    with config_errors_as_usage():
        replay.replay_config(args)
        if args.planner:
            from pdcluster.router.sim import planner_replay

            planner_replay.planner_config(args)
        if args.synthetic and not args.scale > 0:
            raise ValueError(f"--scale must be > 0, got {args.scale}")
    return report(replay.run)(args)


def add_trace_gen(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, "trace-gen",
        "Write a synthetic trace in the Mooncake format (router/sim/trace_gen.py: "
        + ", ".join(sorted(trace_gen.GENERATORS)) + "), deterministic in --seed; prints its "
        "size and prefix reuse as JSON.",
        _cmd_trace_gen)
    parser.add_argument("name", choices=sorted(trace_gen.GENERATORS), help="which trace")
    parser.add_argument("--out", required=True, help="file to write (JSON lines)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="sessions x this, at the same arrival rate")


def _cmd_trace_gen(args: argparse.Namespace) -> int:
    with config_errors_as_usage():
        rows = trace_gen.generate(args.name, args.seed, args.scale)
    trace_gen.write_trace(rows, args.out)
    print(json.dumps({"trace": args.name, "seed": args.seed, "out": args.out,
                      **trace_gen.trace_stats(rows)}, sort_keys=True))
    return 0
