"""`pdcluster serve`, `pdcluster router serve` and `pdcluster metadata serve`: the commands
that run services until SIGINT/SIGTERM. Heavy imports happen inside the handlers, so
`pdcluster --help` stays fast and torch-free."""

from __future__ import annotations

import argparse
import asyncio
import os

from pdcluster.cluster.cli_common import (
    DTYPES,
    UsageError,
    add_command,
    cache_salt_key_from_env,
    check_model_dir,
    cluster_secret_from_env,
    config_errors_as_usage,
    formatter,
    optional_router_token,
    resolve_model_arg,
    router_token_from_env,
)
from pdcluster.cluster.cli_metadata_ops import (
    add_etcd_access_args,
    add_etcd_setup,
    add_metadata_operator_commands,
    etcd_access_fields,
)
from pdcluster.cluster.cli_planner import add_planner_args, planner_fields
from pdcluster.cluster.cli_pod_identity import add_pod_identity_args, pod_identity_config
from pdcluster.core.tls import MetadataTLSFields


def add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "serve",
        "Serve the cluster on a local Ray: prefill and decode node actors, the metadata "
        "service and the OpenAI-compatible router. Runs until Ctrl-C. The cluster secret "
        "comes from $PDCLUSTER_CLUSTER_SECRET or $PDCLUSTER_CLUSTER_SECRET_FILE; without "
        "either a new one is generated and written to a 0600 file whose path is printed.",
        _cmd_serve,
    )
    parser.add_argument("--model", required=True,
                        help="HF-format model folder, or a GGUF file (converted once into a "
                        "cache); the API's model name is the folder's (or file's) name")
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill node actors")
    parser.add_argument("--num-decode", type=int, default=1, help="decode node actors")
    parser.add_argument("--host", default="127.0.0.1", help="router listen address")
    parser.add_argument("--port", type=int, default=8000, help="router port")
    parser.add_argument("--metadata", default=None,
                        help="address of a running metadata service (default: an embedded "
                        "in-memory one)")
    add_metadata_tls_args(parser)
    add_engine_arg(parser)
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="weights and KV dtype (default: float32 on CPU, half on CUDA)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV block (default: 16; 32 with --engine vllm, whose "
                        "CPU kernels take multiples of 32)")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV cache memory per node (default: the engine's own)")
    parser.add_argument("--host-cache-gib", type=float, default=None,
                        help="host memory per node for the KV host tier below the device's "
                        "cache (the own engine; default: none)")
    parser.add_argument("--disk-cache-gib", type=float, default=None,
                        help="local disk per node for the KV disk tier below the host tier "
                        "(the own engine; needs --host-cache-gib; default: none)")
    parser.add_argument("--gpus-per-node", type=float, default=0.0,
                        help="Ray GPUs per node actor and tensor-parallel rank (1 on a GPU "
                        "machine: a node of TP=N takes N)")
    for role in ("prefill", "decode"):
        parser.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None,
                            metavar="N", help=f"tensor-parallel ranks of each {role} node "
                            "(the own engine; prefill and decode may differ; default: 1)")
    parser.add_argument("--speculative", default=None, metavar="SPEC",
                        help="speculative decoding on decode nodes: ngram:k=4 (prompt "
                        "lookup) or draft:PATH,k=4 (a smaller model, same tokenizer); "
                        "default: off")
    parser.add_argument("--local-prefill-threshold", type=int, default=None,
                        help="uncached prompt tokens up to which the decode node prefills "
                        "itself; longer prompts go through a prefill node (0: every new "
                        "prompt does; default: 32)")
    add_routing_arg(parser)
    parser.add_argument("--node-metrics-port", type=int, default=None,
                        help="serve each node's Prometheus metrics on this port of its host "
                        "(0: a free port each, listed in the metadata service; default: none)")
    add_planner_args(parser)


def add_engine_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("pdcluster", "vllm"), default="pdcluster",
                        help="the nodes' engine: pdcluster's own, or vLLM (`make setup-vllm`; "
                        "every node runs it, behind the same connector, index and router)")


def default_block_size(args: argparse.Namespace) -> int:
    return args.block_size or (32 if args.engine == "vllm" else 16)


def add_routing_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--routing", choices=("kv", "round_robin", "least_loaded"),
                        default="kv", help="kv: by cached prefix and load; round_robin / "
                        "least_loaded: cache-blind baselines, for comparisons")


def _cmd_serve(args: argparse.Namespace) -> int:
    model = resolve_model_arg(args.model)
    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.launch import serve

    engine: dict[str, object] = {"block_size": default_block_size(args)}
    if args.engine != "pdcluster":
        engine["backend"] = args.engine
    if args.dtype:
        engine["dtype"] = args.dtype
    if args.kv_cache_gib:
        engine["kv_cache_memory_gib"] = args.kv_cache_gib
    if args.host_cache_gib is not None:
        engine["host_cache_gib"] = args.host_cache_gib
    if args.disk_cache_gib is not None:
        engine["disk_cache_gib"] = args.disk_cache_gib
    if args.speculative:
        engine["speculative"] = _speculative_arg(args.speculative)
    thresholds = {} if args.local_prefill_threshold is None else {
        "local_prefill_threshold_tokens": args.local_prefill_threshold}
    with config_errors_as_usage():
        config = ClusterConfig(model=model, num_prefill=args.num_prefill,
                               num_decode=args.num_decode, engine=engine,
                               metadata_address=args.metadata, router_host=args.host,
                               router_port=args.port, node_gpus=args.gpus_per_node,
                               prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
                               decode_tensor_parallel_size=args.decode_tensor_parallel_size,
                               routing=args.routing, node_metrics_port=args.node_metrics_port,
                               **thresholds, **metadata_tls_fields(args),
                               **planner_fields(args))
    return serve(config, cluster_secret=_serve_secret())


def _speculative_arg(text: str) -> str:
    """`--speculative`, checked here so a typo is a usage error before anything starts."""
    from pdcluster.engine.spec_decode.config import SpeculativeConfig

    with config_errors_as_usage():
        SpeculativeConfig.parse(text)
    return text


def _serve_secret():
    """The secret from the environment, or a new one written (0600) under the user's cache,
    for operators' tools (`PDCLUSTER_CLUSTER_SECRET_FILE=<path> pdcluster router serve`).
    The file is named per process and removed at exit: it is good for this cluster only."""
    import atexit
    from pathlib import Path

    from pdcluster.core.credentials import (
        SECRET_ENV,
        SECRET_FILE_ENV,
        ClusterSecret,
        write_secret_file,
    )

    if os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV):
        return cluster_secret_from_env("pdcluster serve")
    secret = ClusterSecret.generate()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdcluster"
    path = write_secret_file(secret, cache / f"cluster-secret-{os.getpid()}")
    atexit.register(path.unlink, missing_ok=True)
    print(f"pdcluster: generated a cluster secret, saved to {path} (mode 0600; "
          f"{SECRET_FILE_ENV}={path} lets other tools join this cluster)", flush=True)
    return secret


def add_metadata_tls_args(parser: argparse.ArgumentParser) -> None:
    """TLS to an external metadata service (`pdcluster serve` hands them to every node)."""
    parser.add_argument("--metadata-tls-ca", default=None,
                        help="PEM CA that signed the metadata service's certificate: connect "
                        "with TLS (default: plaintext)")
    parser.add_argument("--metadata-tls-cert", default=None,
                        help="PEM client certificate to present (mTLS; with --metadata-tls-key)")
    parser.add_argument("--metadata-tls-key", default=None,
                        help="PEM private key of --metadata-tls-cert")
    parser.add_argument("--metadata-tls-server-name", default=None,
                        help="name to check in the service's certificate (default: the host "
                        "of the metadata address)")


def metadata_tls_fields(args: argparse.Namespace) -> MetadataTLSFields:
    return {"metadata_tls_ca": args.metadata_tls_ca, "metadata_tls_cert": args.metadata_tls_cert,
            "metadata_tls_key": args.metadata_tls_key,
            "metadata_tls_server_name": args.metadata_tls_server_name}


def add_router(subparsers: argparse._SubParsersAction) -> None:
    router = subparsers.add_parser(
        "router", help="The OpenAI-compatible router on its own (nodes found through the "
        "metadata service).", formatter_class=formatter)
    commands = router.add_subparsers(dest="router_command", metavar="COMMAND", required=True)
    serve = add_command(
        commands, "serve",
        "Serve the HTTP API until SIGINT/SIGTERM. API keys, if any, are read from "
        "$PDCLUSTER_API_KEYS (comma-separated, 'tenant:key' or 'key'); the router's client "
        "credential (required) from $PDCLUSTER_ROUTER_TOKEN or the file "
        "$PDCLUSTER_ROUTER_TOKEN_FILE names (`pdcluster metadata router-token` prints one). "
        "The router never needs the cluster secret.",
        _cmd_router_serve,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--also-listen", action="append", default=[], metavar="ADDRESS",
                       help="another address to listen on, same port (repeatable): e.g. "
                       "127.0.0.1 beside a pod's IP, for `kubectl port-forward`")
    serve.add_argument("--port", type=int, default=8000, help="port")
    serve.add_argument("--admin-port", type=int, default=None,
                       help="serve /metrics and the detailed /health here, without an API key "
                       "(keep it off the Ingress); unset: the public port serves them behind "
                       "the key")
    serve.add_argument("--admin-host", default="127.0.0.1", help="address of --admin-port")
    serve.add_argument("--model", required=True,
                       help="model folder (tokenizer and chat template come from it; nodes "
                       "whose tokenizer differs get no requests)")
    serve.add_argument("--model-name", default="", help="served model name (default: folder)")
    serve.add_argument("--metadata", required=True, help="metadata service address host:port")
    add_metadata_tls_args(serve)
    for gone in ("--block-size", "--engine"):
        serve.add_argument(gone, action=_FromTheNodes, help=argparse.SUPPRESS)
    serve.add_argument("--local-prefill-threshold", type=int, default=256,
                       help="uncached prompt tokens below which the decode node prefills")
    serve.add_argument("--max-migrations", type=int, default=1,
                       help="times a request may move to another node when its decode node "
                       "is lost mid-stream (0: end it with an error)")
    serve.add_argument("--no-index-mirror", dest="index_mirror", action="store_false",
                       help="ask the metadata service per request instead of following its "
                       "index in memory (saves ~225 bytes per indexed block)")
    serve.add_argument("--global-reuse-min-tokens", type=int, default=512,
                       help="cached prefix tokens worth pulling from the node holding them "
                       "instead of recomputing (0: never)")
    add_routing_arg(serve)
    _add_tenant_limit_args(serve)


def _add_tenant_limit_args(serve: argparse.ArgumentParser) -> None:
    """Per-tenant limits on what is in flight (router.planning.tenant_limits)."""
    serve.add_argument("--tenant-max-requests", type=int, default=None,
                       help="requests each tenant (API key's tenant; all requests without "
                       "keys) may have in flight; more get 429 with Retry-After (default: no "
                       "limit)")
    serve.add_argument("--tenant-max-tokens", type=int, default=None,
                       help="tokens (prompt + max_tokens of every sample) each tenant may have "
                       "in flight (default: no limit)")
    serve.add_argument("--tenant-limit", action="append", default=[],
                       metavar="NAME:REQUESTS:TOKENS",
                       help="one tenant's own limits instead of the defaults (repeatable; an "
                       "empty number: no limit)")
    serve.add_argument("--prep-threads", type=int, default=2,
                       help="threads that parse and tokenize request bodies off the event loop")


class _FromTheNodes(argparse.Action):
    """A flag `router serve` no longer takes, refused by name rather than ignored: the router
    hashes prompts with the KV identity the nodes register (router.routing.identity)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is not the router's to set: it takes the block size and "
                     f"the hash algorithm and seed from the KV identity the nodes register with "
                     f"the metadata service (docs/router.md, \"One KV identity\")")


def _cmd_router_serve(args: argparse.Namespace) -> int:
    check_model_dir(args.model)
    token = router_token_from_env("pdcluster router serve")
    from pdcluster.cluster.launch import api_keys_from_env
    from pdcluster.router.api.server import serve_forever
    from pdcluster.router.config import RouterConfig
    from pdcluster.router.planning.tenant_limits import TenantLimits
    from pdcluster.router.routing.policy import PolicyConfig

    api_keys = api_keys_from_env()
    salt_key = cache_salt_key_from_env("pdcluster router serve", required=bool(api_keys))
    with config_errors_as_usage():
        limits = TenantLimits(args.tenant_max_requests, args.tenant_max_tokens,
                              tuple(TenantLimits.parse_tenant(e) for e in args.tenant_limit))
        config = RouterConfig(
            model_dir=args.model, model_name=args.model_name, host=args.host, port=args.port,
            also_listen=tuple(args.also_listen), metadata_address=args.metadata,
            api_keys=api_keys, cache_salt_key=salt_key,
            metadata_token=token, admin_port=args.admin_port, admin_host=args.admin_host,
            **metadata_tls_fields(args),
            max_migrations=args.max_migrations, index_mirror=args.index_mirror,
            routing=args.routing, tenant_limits=limits, prep_threads=args.prep_threads,
            policy=PolicyConfig(local_prefill_threshold=args.local_prefill_threshold,
                                global_reuse_min_tokens=args.global_reuse_min_tokens))
    asyncio.run(serve_forever(config))
    return 0


def add_metadata(subparsers: argparse._SubParsersAction) -> None:
    metadata = subparsers.add_parser(
        "metadata",
        help="The metadata service (global block index, node registry).",
        description="The metadata service: node registry with leases, the global block "
        "index and prefix queries over gRPC.",
        formatter_class=formatter,
    )
    commands = metadata.add_subparsers(dest="metadata_command", metavar="COMMAND", required=True)
    serve = add_command(
        commands, "serve",
        "Serve until SIGINT/SIGTERM. Every call must carry a token derived from the cluster "
        "secret (required), read from $PDCLUSTER_CLUSTER_SECRET or the file "
        "$PDCLUSTER_CLUSTER_SECRET_FILE names.",
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
    serve.add_argument("--tls-client-ca", default=None,
                       help="PEM CA: require every client to present a certificate it signed "
                       "(mTLS; needs --tls-cert). Tokens are still checked on every call")
    serve.add_argument("--tls-bind-client-roles", action="store_true",
                       help="mTLS: refuse a token whose principal the client certificate's "
                       "role (common name pdcluster-router/-node/-operator) may not present")
    serve.add_argument("--replica-id", default="", help="name in etcd (default: random)")
    serve.add_argument("--allow-nodes", action="append", default=None, metavar="ROLE=ID,...",
                       help="only these node ids may register in this role (prefill or "
                       "decode; repeat per role); default: any id. The chart lists the ids "
                       "its launcher starts")
    serve.add_argument("--max-nodes", action="append", default=None, metavar="ROLE=N",
                       help="at most N live nodes in this role (repeat per role); default: no "
                       "limit. The chart's bound when its planner names the nodes")
    serve.add_argument("--max-node-blocks", type=int, default=1_000_000,
                       help="most blocks one node may hold in the index (also capped at 64x "
                       "the capacity it declares)")
    add_etcd_access_args(serve)
    add_pod_identity_args(serve)
    add_metadata_operator_commands(commands, add_metadata_tls_args)
    add_etcd_setup(commands)


def node_allowlist(specs: list[str] | None) -> dict[str, frozenset[str]] | None:
    """`--allow-nodes prefill=p0,p1 --allow-nodes decode=d0` -> {role: ids}; None: any id."""
    if specs is None:
        return None
    allowed: dict[str, frozenset[str]] = {}
    for spec in specs:
        role, sep, ids = spec.partition("=")
        if not sep or role not in ("prefill", "decode"):
            raise UsageError(f"--allow-nodes {spec!r}: expected prefill=ID,... or decode=ID,...")
        allowed[role] = allowed.get(role, frozenset()) | {i for i in ids.split(",") if i}
    return allowed


def max_nodes(specs: list[str] | None) -> dict[str, int] | None:
    """`--max-nodes prefill=4 --max-nodes decode=8` -> {role: count}; None: no limit."""
    if specs is None:
        return None
    limits: dict[str, int] = {}
    for spec in specs:
        role, sep, count = spec.partition("=")
        if not sep or role not in ("prefill", "decode") or not count.isdigit():
            raise UsageError(f"--max-nodes {spec!r}: expected prefill=N or decode=N")
        limits[role] = int(count)
    return limits


def _cmd_metadata_serve(args: argparse.Namespace) -> int:
    secret = cluster_secret_from_env("pdcluster metadata serve")
    from pdcluster.metadata_service.config import MetadataConfig
    from pdcluster.metadata_service.server import serve

    etcd_access = etcd_access_fields(args)
    with config_errors_as_usage():
        config = MetadataConfig(
            host=args.host, port=args.port, backend=args.backend,
            etcd_endpoints=tuple(e.strip() for e in args.etcd.split(",") if e.strip()),
            etcd_prefix=args.etcd_prefix, hash_size=args.hash_size,
            default_lease_ttl_s=args.lease_ttl, flush_interval_s=args.flush_interval,
            cluster_secret=secret, router_token=optional_router_token(),
            tls_cert_file=args.tls_cert, tls_key_file=args.tls_key,
            tls_client_ca_file=args.tls_client_ca,
            tls_bind_client_roles=args.tls_bind_client_roles, replica_id=args.replica_id,
            node_allowlist=node_allowlist(args.allow_nodes),
            max_nodes=max_nodes(args.max_nodes),
            max_node_blocks=args.max_node_blocks, pod_identity=pod_identity_config(args),
            **etcd_access,
        )

    def ready(port: int) -> None:
        print(f"metadata service ({config.backend}) listening on {config.host}:{port}",
              flush=True)

    from pdcluster.core.tls import TLSFileError
    from pdcluster.metadata_service.etcd_access import EtcdAccessError

    try:
        asyncio.run(serve(config, ready))
    except (EtcdAccessError, TLSFileError) as exc:  # etcd's credentials, read at start
        raise UsageError(str(exc)) from exc
    return 0
