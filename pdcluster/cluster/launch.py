"""Serve the whole cluster: node actors on Ray, the metadata service they register with, and
the router in front — the all-in-one `pdcluster serve` (local Ray) and the entrypoint for
`ray job submit` (joins the running Ray cluster):

    ray job submit --working-dir . -- python -m cluster.launch --config cluster.yaml

Runs until SIGINT/SIGTERM, then stops the router, drains the nodes and releases Ray.
API keys for the router come from PDCLUSTER_API_KEYS (comma-separated). The cluster secret
(core.credentials) comes from PDCLUSTER_CLUSTER_SECRET or the file PDCLUSTER_CLUSTER_SECRET_FILE
names (the Helm chart mounts it); it is required unless the metadata service and the router are
both embedded here, in which case a fresh one is generated.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.ray_cluster import RayCluster
from pdcluster.core.credentials import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    SERVICE,
    ClusterSecret,
    CredentialError,
)

if TYPE_CHECKING:  # the router loads only when the cluster serves one
    from pdcluster.router.config import RouterConfig

logger = logging.getLogger(__name__)
API_KEYS_ENV = "PDCLUSTER_API_KEYS"


def serve(config: ClusterConfig, ray_address: str | None = None,
          on_ready: Callable[[str], None] | None = None,
          cluster_secret: ClusterSecret | None = None) -> int:
    cluster = RayCluster(config, ray_address, cluster_secret).start()
    try:
        asyncio.run(_run(config, cluster, on_ready))
    finally:
        cluster.stop()
    return 0


async def _run(config: ClusterConfig, cluster: RayCluster,
               on_ready: Callable[[str], None] | None) -> None:
    from pdcluster.router.api.server import serve_forever, wait_for_signal

    if not config.router_enabled:  # e.g. the Helm chart runs the router as a Deployment
        if config.planner is not None and config.planner.router_url:
            cluster.attach_router(config.planner.router_url.rstrip("/"))
        print(f"pdcluster: {config.num_prefill} prefill + {config.num_decode} decode nodes up",
              flush=True)
        await wait_for_signal()
        return

    def ready(base_url: str) -> None:
        host = "127.0.0.1" if config.router_host in ("0.0.0.0", "::") else config.router_host
        keys = api_keys_from_env()
        # the planner (if any) reads the router's metrics and /health from here on
        cluster.attach_router(f"http://{host}:{base_url.rsplit(':', 1)[1].split('/')[0]}",
                              keys[0].partition(":")[2] or keys[0] if keys else None)
        print(f"pdcluster: serving {config.num_prefill} prefill + {config.num_decode} decode "
              f"nodes at {base_url} (metadata service at {cluster.metadata_address})",
              flush=True)
        if on_ready is not None:
            on_ready(base_url)

    if cluster.cluster_secret is None:
        raise ValueError("an in-process router needs the cluster secret (its client "
                         "credential is derived from it)")
    await serve_forever(router_config(config, cluster.metadata_address, cluster.cluster_secret),
                        ready)


def router_config(config: ClusterConfig, metadata_address: str | None,
                  cluster_secret: ClusterSecret) -> RouterConfig:
    from pdcluster.core.kv_identity import KVIdentity
    from pdcluster.router.config import RouterConfig
    from pdcluster.router.routing.policy import PolicyConfig

    policy = PolicyConfig(local_prefill_threshold=config.local_prefill_threshold_tokens,
                          global_reuse_min_tokens=config.global_reuse_min_tokens)
    engine = config.engine_config
    # cluster.yaml names the cluster's KV identity: the one every node it launches registers
    identity = KVIdentity.of(engine.block_size, engine.hash_config, config.model)
    # the router gets its client credential, never the secret (core.credentials)
    return RouterConfig(model_dir=config.model, host=config.router_host,
                        port=config.router_port, metadata_address=metadata_address,
                        metadata_token=cluster_secret.metadata_token(SERVICE),
                        **config.metadata_tls_fields(),
                        api_keys=api_keys_from_env(), policy=policy, routing=config.routing,
                        cache_salt_key=cache_salt_key(cluster_secret),
                        cluster_identity=identity, admission=config.admission,
                        tenant_limits=config.tenant_limits)


def cache_salt_key(cluster_secret: ClusterSecret) -> bytes:
    """The in-process router's cache-salt key (router.tenants): $PDCLUSTER_CACHE_SALT_KEY
    [_FILE] when set (to share salts with routers run apart), else derived from the cluster
    secret, so a restart with the same secret keeps the same salts. The router gets the
    derived key, never the secret."""
    from pdcluster.core.credentials import token_from_env
    from pdcluster.router.tenants import SALT_KEY_ENV, SALT_KEY_FILE_ENV

    given = token_from_env(SALT_KEY_ENV, SALT_KEY_FILE_ENV)
    return given.encode() if given else cluster_secret.derive("router/cache-salt-key")


def api_keys_from_env() -> tuple[str, ...]:
    return tuple(k for k in os.environ.get(API_KEYS_ENV, "").split(",") if k)


def needs_cluster_secret(config: ClusterConfig) -> bool:
    """Whether this launcher needs the cluster secret: for an in-process router or nodes of
    an external metadata service (their tokens), or for a router elsewhere to share an
    embedded service's. Not when the nodes get their tokens for their pods' identity and the
    router runs elsewhere (the chart's head holds no secret then)."""
    if config.metadata_address is None:
        return not config.router_enabled
    return config.router_enabled or config.node_identity_token_file is None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdcluster.cluster.launch",
        description="Launch pdcluster onto the Ray cluster this job runs in (ray job submit).")
    parser.add_argument("--config", required=True, help="cluster.yaml")
    parser.add_argument("--ray-address", default="auto",
                        help="Ray cluster to join ('auto': the one this job was submitted to)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = ClusterConfig.from_yaml(args.config)
    except (OSError, ValueError, KeyError) as exc:
        print(f"pdcluster.cluster.launch: bad config {args.config}: {exc}", file=sys.stderr)
        return 2
    try:
        secret = ClusterSecret.from_env()
    except CredentialError as exc:
        print(f"pdcluster.cluster.launch: {exc}", file=sys.stderr)
        return 2
    if secret is None and needs_cluster_secret(config):
        print(f"pdcluster.cluster.launch: the cluster secret is required when the metadata "
              f"service or the router runs elsewhere: set ${SECRET_FILE_ENV} (a mounted Secret) or "
              f"${SECRET_ENV} (or, on Kubernetes with the router elsewhere, let the nodes "
              f"get their tokens for their pods' identity: metadata.node_identity_token_file)",
              file=sys.stderr)
        return 2
    return serve(config, ray_address=args.ray_address, cluster_secret=secret)


if __name__ == "__main__":
    sys.exit(main())
