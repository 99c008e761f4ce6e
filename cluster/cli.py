"""The `pdcluster` command line.

Subcommands:
  make-tiny-model OUT_DIR   build a small random HF-format model with a real tokenizer
  generate --model DIR      run the engine offline on one prompt
  serve --model DIR         serve the cluster on a local Ray: nodes, metadata service, router
  router serve              run the router alone (nodes found through the metadata service)
  metadata serve            run the metadata service (gRPC; memory or etcd backend)
  bench engine              run the engine benchmark; the last stdout line is its JSON result
  bench metadata            run the metadata-service benchmark (same JSON-last convention)
  bench transfer            run the KV-transfer benchmark (same JSON-last convention)
  bench serve               run the serving benchmark on a local Ray cluster (JSON last)
  bench router              run the router-overhead benchmark (JSON last)
  replay --trace FILE       replay a request trace through the routing policy (JSON last)

`pdcluster --help` must stay fast and torch-free, so `engine` and `benchmarks` are imported only
inside the handlers that need them. API: `main(argv) -> int` (exit status).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

# Mirrors engine.tiny_model.ARCHS / PRESETS; repeated here so that --help never imports torch.
TINY_ARCHS = ("llama", "qwen2", "mistral")
TINY_PRESETS = ("tiny", "bench")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A user mistake found after parsing: reported as one line on stderr, exit status 2."""


def parse_token_ids(text: str) -> list[int]:
    """Parse "1,2,3" into [1, 2, 3]; argparse reports a bad value as a usage error."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated token ids, e.g. 1,2,3")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0: {text!r}")
    return ids


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the uninformative None and False."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return _HelpFormatter(prog, max_help_position=32)


def _add_command(
    subparsers: argparse._SubParsersAction, name: str, help_text: str, handler: Handler
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        name, help=help_text, description=help_text, formatter_class=_formatter
    )
    parser.set_defaults(handler=handler)
    return parser


def _add_make_tiny_model(subparsers: argparse._SubParsersAction) -> None:
    parser = _add_command(
        subparsers,
        "make-tiny-model",
        "Build a small random-weight HF-format model (safetensors + a real SentencePiece "
        "tokenizer) for tests and the default run. Needs no network.",
        _cmd_make_tiny_model,
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write the model into")
    parser.add_argument("--arch", choices=TINY_ARCHS, default="llama", help="model family")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    parser.add_argument(
        "--preset",
        choices=TINY_PRESETS,
        default="tiny",
        help="size: 'tiny' for tests, 'bench' for benchmarks",
    )


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = _add_command(
        subparsers,
        "generate",
        "Generate a completion for one prompt with the local engine (no cluster).",
        _cmd_generate,
    )
    parser.add_argument("--model", required=True, help="HF-format model folder")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    prompt.add_argument(
        "--prompt-ids",
        type=parse_token_ids,
        metavar="IDS",
        help='prompt as comma-separated token ids, e.g. "1,2,3"',
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="0 means no top-k cut")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV dtype")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where to run")
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV cache blocks (default: the engine sizes the cache itself)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = _add_command(
        subparsers,
        "serve",
        "Serve the cluster on a local Ray: prefill and decode node actors, the metadata "
        "service and the OpenAI-compatible router. Runs until Ctrl-C.",
        _cmd_serve,
    )
    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill node actors")
    parser.add_argument("--num-decode", type=int, default=1, help="decode node actors")
    parser.add_argument("--host", default="127.0.0.1", help="router listen address")
    parser.add_argument("--port", type=int, default=8000, help="router port")
    parser.add_argument("--metadata", default=None,
                        help="address of a running metadata service (default: an embedded "
                        "in-memory one)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="weights and KV dtype (default: float32 on CPU, half on CUDA)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV cache memory per node (default: the engine's own)")
    parser.add_argument("--gpus-per-node", type=float, default=0.0,
                        help="Ray GPUs per node actor (1 on a GPU machine)")


def _cmd_serve(args: argparse.Namespace) -> int:
    _check_model_dir(args.model)
    from cluster.config import ClusterConfig
    from cluster.launch import serve

    engine = {"block_size": args.block_size}
    if args.dtype:
        engine["dtype"] = args.dtype
    if args.kv_cache_gib:
        engine["kv_cache_memory_gib"] = args.kv_cache_gib
    with _config_errors_as_usage():
        config = ClusterConfig(model=args.model, num_prefill=args.num_prefill,
                               num_decode=args.num_decode, engine=engine,
                               metadata_address=args.metadata, router_host=args.host,
                               router_port=args.port, node_gpus=args.gpus_per_node)
    return serve(config)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="Run a benchmark; each prints one JSON object as its last line.",
        description="Run a benchmark. Each prints one JSON object (with its own baseline, "
        "measured in the same run) as the last line of stdout.",
        formatter_class=_formatter,
    )
    benchmarks = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    # Built here rather than by benchmarks.engine_bench so that parsing never imports it.
    engine = _add_command(
        benchmarks,
        "engine",
        "Engine throughput and latency on a tiny random model, against a baseline "
        "measured in the same run.",
        _bench_command("engine_bench"),
    )
    engine.add_argument("--json", action="store_true", help="print only the JSON line")
    engine.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)"
    )
    engine.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    engine.add_argument("--device", choices=DEVICES, default="cpu", help="where to run")
    metadata = _add_command(
        benchmarks,
        "metadata",
        "Metadata service: prefix-query latency over gRPC (against an empty RPC in the same "
        "run), ingest rate, etcd write rate, recovery time and index memory.",
        _bench_command("metadata_bench"),
    )
    metadata.add_argument("--json", action="store_true", help="print only the JSON line")
    metadata.add_argument("--nodes", type=int, default=64, help="registered nodes")
    metadata.add_argument("--blocks", type=int, default=1_000_000, help="indexed blocks")
    metadata.add_argument("--queries", type=int, default=2000, help="timed queries")
    metadata.add_argument("--chain", type=int, default=128, help="blocks per query chain")
    metadata.add_argument("--no-etcd", action="store_true",
                          help="skip the etcd part (write rate and recovery)")
    metadata.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    transfer = _add_command(
        benchmarks,
        "transfer",
        "KV transfer between two processes through the connector (Mooncake over TCP here), "
        "against one raw contiguous Mooncake write of the same bytes in the same run.",
        _bench_command("transfer_bench"),
    )
    transfer.add_argument("--json", action="store_true", help="print only the JSON line")
    transfer.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    router = _add_command(
        benchmarks,
        "router",
        "The router's own cost: decision time over a 1M-block index of 64 nodes, latency "
        "overhead against a direct node call (same run), requests/s at 64 streaming clients.",
        _bench_command("router_bench"),
    )
    router.add_argument("--json", action="store_true", help="print only the JSON line")
    router.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    serve = _add_command(
        benchmarks,
        "serve",
        "TTFT of 2,048-token prompts disaggregated vs colocated on a local 1+1 cluster, "
        "KV transfer time, inter-token latency and throughput (same run).",
        _bench_command("serve_bench"),
    )
    serve.add_argument("--json", action="store_true", help="print only the JSON line")
    serve.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")


REPLAY_POLICIES = ("kv", "round-robin", "least-loaded")


def _add_replay(subparsers: argparse._SubParsersAction) -> None:
    replay = _add_command(
        subparsers,
        "replay",
        "Replay a request trace (JSONL: timestamp, input_length, output_length, hash_ids) "
        "through the router's policy over simulated LRU-cache nodes feeding the real block "
        "index. Reports hit_ratio, work_imbalance and ideal_hit_ratio for the chosen policy "
        "and for round-robin and least-loaded, measured in the same run.",
        _cmd_replay,
    )
    replay.add_argument("--trace", required=True, help="trace file (JSON lines)")
    replay.add_argument("--nodes", type=int, default=8, help="simulated nodes")
    replay.add_argument("--cache-blocks", type=int, default=100_000,
                        help="blocks of cache over all nodes (each node holds C/N)")
    replay.add_argument("--policy", choices=REPLAY_POLICIES, default="kv", help="routing policy")
    replay.add_argument("--seed", type=int, default=0, help="seed of the tie-breaking RNG")
    replay.add_argument("--json", action="store_true", help="print only the JSON line")


METADATA_TOKEN_ENV = "PDCLUSTER_METADATA_TOKEN"


def _add_router(subparsers: argparse._SubParsersAction) -> None:
    router = subparsers.add_parser(
        "router", help="The OpenAI-compatible router on its own (nodes found through the "
        "metadata service).", formatter_class=_formatter)
    commands = router.add_subparsers(dest="router_command", metavar="COMMAND", required=True)
    serve = _add_command(
        commands, "serve",
        "Serve the HTTP API until SIGINT/SIGTERM. API keys, if any, are read from "
        "$PDCLUSTER_API_KEYS (comma-separated), the metadata token from "
        f"${METADATA_TOKEN_ENV}.",
        _cmd_router_serve,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port")
    serve.add_argument("--model", required=True,
                       help="model folder (tokenizer and chat template come from it)")
    serve.add_argument("--model-name", default="", help="served model name (default: folder)")
    serve.add_argument("--metadata", required=True, help="metadata service address host:port")
    serve.add_argument("--block-size", type=int, default=16, help="the nodes' KV block size")
    serve.add_argument("--local-prefill-threshold", type=int, default=256,
                       help="uncached prompt tokens below which the decode node prefills")


def _cmd_router_serve(args: argparse.Namespace) -> int:
    _check_model_dir(args.model)
    from cluster.launch import api_keys_from_env
    from router.config import RouterConfig
    from router.policy import PolicyConfig
    from router.server import serve_forever

    with _config_errors_as_usage():
        config = RouterConfig(
            model_dir=args.model, model_name=args.model_name, host=args.host, port=args.port,
            metadata_address=args.metadata, api_keys=api_keys_from_env(),
            metadata_token=os.environ.get(METADATA_TOKEN_ENV),
            policy=PolicyConfig(block_size=args.block_size,
                                local_prefill_threshold=args.local_prefill_threshold))
    asyncio.run(serve_forever(config))
    return 0


def _add_metadata(subparsers: argparse._SubParsersAction) -> None:
    metadata = subparsers.add_parser(
        "metadata",
        help="The metadata service (global block index, node registry).",
        description="The metadata service: node registry with leases, the global block "
        "index and prefix queries over gRPC.",
        formatter_class=_formatter,
    )
    commands = metadata.add_subparsers(dest="metadata_command", metavar="COMMAND", required=True)
    serve = _add_command(
        commands, "serve",
        "Serve until SIGINT/SIGTERM. The shared token, if any, is read from "
        f"${METADATA_TOKEN_ENV}.",
        _cmd_metadata_serve,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=50061, help="port (0: any free port)")
    serve.add_argument("--backend", choices=("memory", "etcd"), default="memory",
                       help="memory: embedded, nothing persists; etcd: durable, replicas")
    serve.add_argument("--etcd", default="127.0.0.1:2379",
                       help="comma-separated etcd endpoints host:port")
    serve.add_argument("--etcd-prefix", default="/pdcluster/metadata", help="etcd key prefix")
    serve.add_argument("--hash-size", type=int, default=32,
                       help="block hash bytes: 32 (sha256) or 16 (xxh3_128)")
    serve.add_argument("--lease-ttl", type=int, default=10, help="default node lease TTL, s")
    serve.add_argument("--flush-interval", type=float, default=0.25,
                       help="etcd: at most one write per node per this many seconds")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    serve.add_argument("--replica-id", default="", help="name in etcd (default: random)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdcluster",
        description="pdcluster: a disaggregated prefill/decode LLM serving cluster.",
        formatter_class=_formatter,
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="logging level",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_make_tiny_model(subparsers)
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_router(subparsers)
    _add_metadata(subparsers)
    _add_bench(subparsers)
    _add_replay(subparsers)
    return parser


def _require_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda given but no CUDA device is available")


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from engine.tiny_model import make_tiny_model

    path = make_tiny_model(args.out_dir, arch=args.arch, seed=args.seed, preset=args.preset)
    print(path)
    return 0


def _check_model_dir(model: str) -> None:
    path = Path(model)
    if not path.is_dir():
        raise UsageError(f"model folder not found: {model}")
    if not (path / "config.json").is_file():
        raise UsageError(f"not an HF-format model folder (no config.json): {model}")


@contextmanager
def _config_errors_as_usage() -> Iterator[None]:
    """Configs validate user values with ValueError at construction: report those as usage."""
    try:
        yield
    except ValueError as exc:
        logger.debug("invalid configuration", exc_info=True)
        raise UsageError(str(exc)) from exc


def _cmd_generate(args: argparse.Namespace) -> int:
    _check_model_dir(args.model)
    _require_device(args.device)
    from engine import LLM, SamplingParams

    extra = {} if args.num_blocks is None else {"num_kv_blocks": args.num_blocks}
    started = time.perf_counter()
    with _config_errors_as_usage():
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        llm = LLM(
            args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            **extra,
        )
    loaded = time.perf_counter()
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    out = llm.generate([prompt], params)[0]
    done = time.perf_counter()
    print(f"prompt: {prompt}")
    print(f"output: {out.text}")
    print(
        f"generated {len(out.token_ids)} tokens in {done - loaded:.3f} s "
        f"(model load {loaded - started:.3f} s)",
        file=sys.stderr,
    )
    return 0


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

    def handler(args: argparse.Namespace) -> int:
        if getattr(args, "device", None):
            _require_device(args.device)
        result = importlib.import_module(f"benchmarks.{module}").run(args)
        if not args.json:
            print(format_table(result))
        print(json.dumps(result, sort_keys=True))
        return 0

    return handler


def _cmd_replay(args: argparse.Namespace) -> int:
    if not Path(args.trace).is_file():
        raise UsageError(f"trace file not found: {args.trace}")
    from benchmarks import replay

    with _config_errors_as_usage():
        replay.ReplayConfig(num_nodes=args.nodes, cache_blocks=args.cache_blocks)
    return _bench_command("replay")(args)


def _cmd_metadata_serve(args: argparse.Namespace) -> int:
    from metadata_service.config import MetadataConfig
    from metadata_service.server import serve

    with _config_errors_as_usage():
        config = MetadataConfig(
            host=args.host, port=args.port, backend=args.backend,
            etcd_endpoints=tuple(e.strip() for e in args.etcd.split(",") if e.strip()),
            etcd_prefix=args.etcd_prefix, hash_size=args.hash_size,
            default_lease_ttl_s=args.lease_ttl, flush_interval_s=args.flush_interval,
            token=os.environ.get(METADATA_TOKEN_ENV) or None,
            tls_cert_file=args.tls_cert, tls_key_file=args.tls_key, replica_id=args.replica_id,
        )

    def ready(port: int) -> None:
        print(f"metadata service ({config.backend}) listening on {config.host}:{port}",
              flush=True)

    asyncio.run(serve(config, ready))
    return 0




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
