"""Starting one node actor on Ray: the launcher's first nodes (cluster.ray_cluster) and the
planner's later ones (cluster.node_fleet) are made the same way.

API: `start_node_actor`.
"""

from __future__ import annotations

from pdcluster.cluster.config import ClusterConfig
from pdcluster.core.credentials import ClusterSecret, node_principal


def start_node_actor(ray, cls, node_id: str, cfg: ClusterConfig, metadata_address: str,
                     cluster_secret: ClusterSecret | None):
    """A node actor of class `cls` (its role) named `pdcluster-<node_id>`, registering with
    the metadata service at `metadata_address` under its own credential: derived here from
    `cluster_secret`, or, with `cfg.node_identity_token_file` (Kubernetes), obtained by the
    node itself for its pod's service-account token (then no secret is needed). With tensor
    parallelism it asks for a GPU set per rank: Ray gives them on one node and makes them the
    actor's visible devices, which its ranks (processes it starts) take in order."""
    resources = {}
    gpus = cfg.node_gpus_of(cls.role)  # a GPU per tensor-parallel rank, on one Ray node
    if cfg.role_resource_prefix and gpus:  # land on this role's worker pods
        resources[f"{cfg.role_resource_prefix}{cls.role}"] = gpus
    remote = ray.remote(cls).options(
        name=f"pdcluster-{node_id}", num_cpus=cfg.node_cpus, num_gpus=gpus,
        resources=resources, max_restarts=cfg.max_restarts, max_task_retries=0,
        max_concurrency=4)
    return remote.remote(node_id, cfg.model, host=cfg.host,
                         engine_options=cfg.engine_options(cls.role),
                         metadata_address=metadata_address,
                         **cfg.metadata_tls_fields(),
                         **_credential(node_id, cfg, cluster_secret),
                         kv_protocol=cfg.kv_protocol, kv_device=cfg.kv_device,
                         kv_timeout_s=cfg.kv_timeout_s, metrics_port=cfg.node_metrics_port,
                         port=cfg.node_request_port, port_span=cfg.node_request_ports,
                         lease_ttl_s=cfg.lease_ttl_s)


def _credential(node_id: str, cfg: ClusterConfig,
                cluster_secret: ClusterSecret | None) -> dict[str, str]:
    """This node's credential only (node/actor.py says why), or where its pod's identity is."""
    if cfg.node_identity_token_file is not None:
        return {"identity_token_file": cfg.node_identity_token_file}
    if cluster_secret is None:
        raise ValueError(f"node {node_id}: no cluster secret to derive its token from, and no "
                         "metadata.node_identity_token_file to get one with")
    return {"bootstrap_token": cluster_secret.metadata_token(node_principal(node_id))}
