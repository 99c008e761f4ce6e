"""The `pdcluster` command line.

Subcommands:
  make-tiny-model OUT_DIR   build a small random HF-format model with a real tokenizer
  convert-gguf GGUF OUT_DIR turn a GGUF file into an HF-format folder (float32)
  generate --model DIR|GGUF run the engine offline on one prompt
  serve --model DIR|GGUF    serve the cluster on a local Ray: nodes, metadata service, router
  router serve              run the router alone (nodes found through the metadata service)
  metadata serve            run the metadata service (gRPC; memory or etcd backend)
  metadata etcd-setup       as etcd's root: a user whose role covers only the metadata prefix
  bench engine              run the engine benchmark; the last stdout line is its JSON result
  bench metadata            run the metadata-service benchmark (same JSON-last convention)
  bench transfer            run the KV-transfer benchmark (same JSON-last convention)
  bench serve               run the serving benchmark on a local Ray cluster (JSON last)
  bench router              run the router-overhead benchmark (JSON last)
  bench curve               run the CURVE-cost benchmark (JSON last)
  bench trace --trace FILE  replay a trace live against a local cluster, per policy (JSON last)
  bench client --url URL    load a served cluster with aiperf (JSON last)
  bench planner             the planner under a load step on a local cluster (JSON last)
  replay --trace FILE       replay a request trace through the routing policy (JSON last)
  replay --synthetic NAME   the same on a generated trace (router/sim/trace_gen.py)
  trace-gen NAME --out FILE write a synthetic trace

`pdcluster --help` must stay fast and torch-free, so `engine` and `benchmarks` are imported only
inside the handlers that need them. `bench` offers what ships in the package
(pdcluster/benchmarks); the harnesses and studies of a checkout (chaos, peers, vLLM against
vLLM offline, …) are `python -m benchmarks NAME` there. API: `main(argv) -> int` (exit status).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable

from pdcluster.cluster import cli_models, cli_replay, cli_services
from pdcluster.cluster.cli_common import (
    DEVICES,
    UsageError,
    add_command,
    formatter,
    require_device,
    resolve_model_arg,
)
from pdcluster.cluster.cli_models import parse_token_ids  # noqa: F401 (part of this module's API)

logger = logging.getLogger(__name__)

# name -> (module in pdcluster/benchmarks/, description). Each takes --json and --quick; some
# take more.
BENCHMARKS = {
    "engine": ("engine_bench", "Engine throughput, batch-1 decode step and 2,048-token TTFT "
               "on --model (default: a random `bench` model), against transformers measured "
               "in the same run."),
    "transfer": ("transfer_bench", "KV transfer between two processes through the connector "
                 "(Mooncake over TCP here), against one raw contiguous Mooncake write of the "
                 "same bytes in the same run."),
    "metadata": ("metadata_bench", "Metadata service: prefix-query latency over gRPC (against "
                 "an empty RPC in the same run), ingest rate, etcd write rate, recovery time "
                 "and index memory."),
    "tp": ("tp_bench", "Tensor parallelism: decode steps (batch 1 and 16) and 512-token TTFT "
           "at TP=1 and TP=N on one random model, each TP=N figure over TP=1's (same run), "
           "tokens compared."),
    "tp-transfer": ("tp_transfer_bench", "KV transfer between tensor-parallel groups: the "
                    "prefill node's write from TP=2 to TP=1 and TP=1 to TP=2, each over the "
                    "same-TP move of the same sender (same run), over Mooncake TCP."),
    "router": ("router_bench", "The router's own cost: decision time over a 1M-block index of "
               "64 nodes, latency overhead against a direct node call (same run), requests/s "
               "at 64 streaming clients."),
    "serve": ("serve_bench", "TTFT of 2,048-token prompts disaggregated vs colocated on a "
              "local 1+1 cluster, KV transfer time, inter-token latency and throughput (same "
              "run)."),
    "curve": ("curve_bench", "The price of ZMQ CURVE on node and KV side-channel sockets: "
              "handshake, round trips and bulk throughput against plaintext sockets in the "
              "same run."),
    "trace": ("trace_bench", "Replay a slice of a Mooncake trace (JSONL: timestamp, "
              "input_length, output_length, hash_ids) against a live local cluster through the "
              "router's HTTP API, once per routing policy (kv, round_robin, least_loaded; caches "
              "reset between them): TTFT and latency p50/p90, output tokens/s, the prefix hit "
              "ratio and blocks moved read from the nodes' metrics, next to what `pdcluster "
              "replay` predicts for the same slice."),
    "client": ("client_bench", "A published load client (aiperf, installed by `make peers` "
               "in its own environment) against a served cluster at --url: TTFT, inter-token "
               "latency, request latency and throughput, against the router's own figures "
               "for the same requests."),
    "planner": ("planner_bench", "The live planner on a local cluster of the tiny model: a load "
                "step up and down; time to scale up, requests lost, blocks leaked, the hit "
                "ratio just after a scale-in over just before it (the drained node's hot "
                "prefixes handed to the node that stays), and admission's sheds per phase."),
}


def _engine_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where to run")
    parser.add_argument("--model", default=None,
                        help="model folder or GGUF file to measure (default: a random model "
                        "of the `bench` preset)")
    parser.add_argument("--speculative", default=None, metavar="SPEC",
                        help="measure decode tokens/s with and without speculative decoding "
                        "(ngram:k=4 or draft:PATH,k=4) instead of the default parts; use a "
                        "model with a chat template (--model)")
    parser.add_argument("--shapes", default="llama-1b,llama-8b",
                        help="with --device cuda and no --model: random bf16 models of these "
                        "shapes (llama-1b, llama-8b, qwen3-30b-a3b: an MoE, deepseek-v2-lite: "
                        "MLA with an MoE), measured "
                        "against the GPU's copy and matmul rates")
    parser.add_argument("--hf-shapes", default="llama-1b",
                        help="with --device cuda: the shapes also run through transformers' "
                        "generate (the baseline); '' for none")
    parser.add_argument("--host-tier", action="store_true",
                        help="measure the TTFT of prompts re-asked after the device KV pool "
                        "cycled (a working set 4x the pool), host tier and disk tier against "
                        "recompute, instead of the default parts")


def _metadata_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=64, help="registered nodes")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="indexed blocks")
    parser.add_argument("--queries", type=int, default=2000, help="timed queries")
    parser.add_argument("--chain", type=int, default=128, help="blocks per query chain")
    parser.add_argument("--no-etcd", action="store_true",
                        help="skip the etcd part (write rate and recovery)")


def _trace_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake trace (JSON lines)")
    parser.add_argument("--offset", type=int, default=0, help="first trace row replayed")
    parser.add_argument("--limit", type=int, default=100, help="trace rows replayed")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="replayed gaps = trace gaps x this (below 1: denser load)")
    parser.add_argument("--tokens-per-block", type=int, default=32,
                        help="real tokens standing for one 512-token trace block")
    parser.add_argument("--max-output-tokens", type=int, default=16,
                        help="cap on each request's output length")
    parser.add_argument("--num-prefill", type=int, default=2, help="prefill node actors")
    parser.add_argument("--num-decode", type=int, default=1, help="decode node actors")
    parser.add_argument("--kv-blocks", type=int, default=2048,
                        help="KV blocks of 16 tokens per node")
    parser.add_argument("--host-blocks", type=int, default=0,
                        help="also run the kv policy on a second cluster whose nodes hold a "
                        "host KV tier of this many blocks below --kv-blocks (0: not run)")
    parser.add_argument("--policies", default="kv,round_robin,least_loaded",
                        help="comma-separated routing policies to run, in order")
    parser.add_argument("--model", default=None,
                        help="model folder (default: a random tiny model built for the run)")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds one request may take before it counts as failed")
    parser.add_argument("--node-timeout", type=float, default=10.0,
                        help="the router's load-poll timeout (a node missing 3 polls in a row "
                        "is taken for dead; a saturated small CPU needs more than the 2 s "
                        "default)")


def _client_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True,
                        help="the server's base URL, e.g. http://127.0.0.1:8000 (a trailing "
                        "/v1 is dropped: aiperf appends the endpoint path)")
    # not `model`: the bench handler would resolve that as a model folder
    parser.add_argument("--model", dest="served_model", required=True,
                        help="the served model name (as /v1/models lists it)")
    parser.add_argument("--tokenizer", required=True,
                        help="local tokenizer folder (usually the model folder)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in flight (default 4; --quick 2)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests to complete (default 32; --quick 8)")
    parser.add_argument("--isl", type=int, default=None,
                        help="synthetic prompt tokens (default 128; --quick 64)")
    parser.add_argument("--osl", type=int, default=None,
                        help="max output tokens per request (default 32; --quick 16)")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="the OpenAI endpoint to load")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="API key (default: $OPENAI_API_KEY)")
    parser.add_argument("--tool-dir", default=None,
                        help="aiperf's virtual environment (default: $PDCLUSTER_AIPERF_DIR "
                        "or .cache/peers/aiperf in the repository)")
    parser.add_argument("--artifact-dir", default=None,
                        help="keep aiperf's exports here (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds the whole aiperf run may take")


def _planner_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model folder (default: a random tiny model built for the run)")
    parser.add_argument("--clients", type=int, default=8, help="clients during the step up")
    parser.add_argument("--max-decode", type=int, default=2, help="most decode nodes")
    parser.add_argument("--slo-factor", type=float, default=2.0,
                        help="the ITL SLO: this x the one-client ITL p90 measured first")
    parser.add_argument("--slo-ttft-s", type=float, default=10.0,
                        help="admission's TTFT SLO (429 above it)")
    parser.add_argument("--hold-s", type=float, default=10.0,
                        help="seconds of step-up load once the new node serves")
    parser.add_argument("--settle-s", type=float, default=5.0,
                        help="seconds of one-client load after the scale-in")
    parser.add_argument("--think-s", type=float, default=0.5,
                        help="seconds the one client waits between requests after the step")


def _tp_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where to run")
    parser.add_argument("--tensor-parallel-size", type=int, default=2,
                        help="the TP size measured against TP=1")


_BENCH_EXTRA_ARGS = {"engine": _engine_bench_args, "metadata": _metadata_bench_args,
                     "client": _client_bench_args, "trace": _trace_bench_args,
                     "planner": _planner_bench_args, "tp": _tp_bench_args}


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="Run a benchmark; each prints one JSON object as its last line.",
        description="Run a benchmark. Each prints one JSON object (with its own baseline, "
        "measured in the same run) as the last line of stdout.",
        formatter_class=formatter,
    )
    benchmarks = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    # Built here rather than by the benchmark modules so that parsing never imports them.
    for name, (module, description) in BENCHMARKS.items():
        parser = add_command(benchmarks, name, description, _bench_command(module))
        parser.add_argument("--json", action="store_true", help="print only the JSON line")
        parser.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
        _BENCH_EXTRA_ARGS.get(name, lambda _: None)(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdcluster",
        description="pdcluster: a disaggregated prefill/decode LLM serving cluster.",
        formatter_class=formatter,
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="logging level",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    cli_models.add_make_tiny_model(subparsers)
    cli_models.add_convert_gguf(subparsers)
    cli_models.add_generate(subparsers)
    cli_services.add_serve(subparsers)
    cli_services.add_router(subparsers)
    cli_services.add_metadata(subparsers)
    _add_bench(subparsers)
    cli_replay.add_replay(subparsers, _report_command)
    cli_replay.add_trace_gen(subparsers)
    return parser


def _flatten(result: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for key in sorted(result):
        value = result[key]
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.extend(_flatten(value, f"{name}."))
        else:
            rows.append((name, value))
    return rows


def format_table(result: dict) -> str:
    """Two aligned columns, nested keys dotted: a human view of a benchmark result."""
    rows = _flatten(result)
    if not rows:
        return ""
    width = max(len(name) for name, _ in rows)
    lines = []
    for name, value in rows:
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<{width}}  {shown}")
    return "\n".join(lines)


def _bench_command(module: str) -> Callable[[argparse.Namespace], int]:
    """A handler that runs `benchmarks.<module>.run(args)` and prints its JSON result last."""
    return _report_command(
        lambda args: importlib.import_module(f"pdcluster.benchmarks.{module}").run(args))


def _report_command(run: Callable[[argparse.Namespace], dict]
                    ) -> Callable[[argparse.Namespace], int]:
    """A handler that runs `run(args)` and prints its result (a table, then the JSON line)."""

    def handler(args: argparse.Namespace) -> int:
        if getattr(args, "device", None):
            require_device(args.device)
        if getattr(args, "model", None):
            args.model = resolve_model_arg(args.model)
        result = run(args)
        if not args.json:
            print(format_table(result))
        print(json.dumps(result, sort_keys=True))
        return 0

    return handler


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.handler(args)
    except UsageError as exc:
        prog = " ".join(["pdcluster", args.command,
                         *filter(None, [getattr(args, "metadata_command", None)])])
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
