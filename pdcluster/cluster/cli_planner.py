"""`pdcluster serve`'s planner and admission flags: `--planner` (scale prefill and decode
nodes live, cluster/live_planner.py) and `--admission` (shed or hold by predicted TTFT,
router/planning/admission.py), turned into `ClusterConfig` fields.

API: `add_planner_args`, `planner_fields`.
"""

from __future__ import annotations

import argparse


def add_planner_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "planner and admission", "--planner scales prefill and decode nodes live from the "
        "router's and the nodes' signals (cluster/live_planner.py), draining a node that "
        "leaves after handing its hot prefixes to the others; --admission sheds requests "
        "whose predicted TTFT misses --slo-ttft-s (429 + Retry-After) or holds them")
    group.add_argument("--planner", action="store_true", help="scale the nodes live")
    group.add_argument("--slo-ttft-s", type=float, default=2.0, help="TTFT SLO, seconds")
    group.add_argument("--slo-itl-ms", type=float, default=50.0, help="inter-token SLO, ms")
    for role in ("prefill", "decode"):
        group.add_argument(f"--min-{role}", type=int, default=None,
                           help=f"fewest {role} nodes (default: 1, or --num-{role} if fewer)")
        group.add_argument(f"--max-{role}", type=int, default=None,
                           help=f"most {role} nodes (default: 4, or --num-{role} if more)")
    group.add_argument("--max-nodes", type=int, default=None,
                       help="prefill + decode nodes at most (default: the sum of the maxima)")
    group.add_argument("--planner-interval-s", type=float, default=10.0,
                       help="seconds between decisions")
    group.add_argument("--startup-s", type=float, default=30.0,
                       help="seconds a new node takes to serve (the planner plans ahead)")
    group.add_argument("--admission", choices=("reject", "queue"), default=None,
                       help="admit by predicted TTFT: shed with 429, or hold (default: off)")


def planner_fields(args: argparse.Namespace) -> dict:
    from pdcluster.cluster.planner_settings import PlannerSettings
    from pdcluster.router.planning.admission import AdmissionConfig

    fields: dict[str, object] = {}
    if args.planner:
        fields["planner"] = PlannerSettings(
            slo_ttft_s=args.slo_ttft_s, slo_itl_ms=args.slo_itl_ms,
            interval_s=args.planner_interval_s, startup_s=args.startup_s,
            min_prefill=_bound(args.min_prefill, min(1, args.num_prefill)),
            max_prefill=_bound(args.max_prefill, max(4, args.num_prefill)),
            min_decode=_bound(args.min_decode, 1),
            max_decode=_bound(args.max_decode, max(4, args.num_decode)),
            max_nodes=args.max_nodes)
    if args.admission:
        fields["admission"] = AdmissionConfig(slo_ttft_s=args.slo_ttft_s, mode=args.admission)
    return fields


def _bound(given: int | None, default: int) -> int:
    return default if given is None else given
