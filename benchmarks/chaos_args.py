"""`python -m benchmarks chaos`'s options (the harness is benchmarks/chaos_bench.py; parsing
them imports none of it)."""

from __future__ import annotations

import argparse


def add_chaos_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--faults", default="prefill_kill,decode_kill,abort_storm,"
                        "metadata_stall,metadata_restart,node_restart",
                        help="comma-separated faults, run in order (etcd_restart needs "
                        "--backend etcd)")
    parser.add_argument("--model", default=None,
                        help="model folder (default: a random tiny model built for the run)")
    parser.add_argument("--num-prefill", type=int, default=2, help="prefill node actors")
    parser.add_argument("--num-decode", type=int, default=2, help="decode node actors")
    parser.add_argument("--engine", choices=("pdcluster", "vllm"), default="pdcluster",
                        help="the nodes' engine: pdcluster's own, or vLLM on every node "
                        "(`make setup-vllm`; the tiny model is then one vLLM's CPU kernels take)")
    parser.add_argument("--backend", choices=("memory", "etcd"), default="memory",
                        help="the metadata service's store (etcd: a real etcd is started)")
    parser.add_argument("--lease-ttl", type=int, default=10, help="node lease TTL, s")
    parser.add_argument("--kv-blocks", type=int, default=512,
                        help="KV blocks per node (of 16 tokens; 32 with --engine vllm)")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second")
    parser.add_argument("--requests", type=int, default=120, help="requests per fault")
    parser.add_argument("--storm-requests", type=int, default=400,
                        help="requests of the abort storm (3 in 4 abandoned by the client)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--soak-s", type=float, default=120.0,
                        help="seconds of the churn soak (0: none)")
